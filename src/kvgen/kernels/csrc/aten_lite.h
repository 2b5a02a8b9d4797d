// The few ATen headers the op files need (not <torch/torch.h>: it triples compile time).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
