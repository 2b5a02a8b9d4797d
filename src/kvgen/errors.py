"""Error classes raised at kvgen's boundaries.

``KvgenError`` subclasses ``ValueError``, so callers that catch ``ValueError`` catch these too; most
other bad input (a setting out of range) raises a plain ``ValueError``. The CLI turns any of these into
one line on stderr and exit code 2.
"""


class KvgenError(ValueError):
    """Base class of kvgen's own error classes (model files, architectures, quantization types, context length, chat
    templates). Other bad input raises a plain ``ValueError``, which ``except ValueError`` catches with these."""


class ModelNotFoundError(KvgenError):
    """A model path or name that does not exist."""


class ModelFormatError(KvgenError):
    """A model file that is corrupt, truncated or not in a format kvgen reads."""


class UnsupportedArchitectureError(KvgenError):
    """A model whose architecture (``model_type``) kvgen has no decoder for."""


class UnsupportedQuantizationError(KvgenError):
    """A GGUF tensor stored in a quantization type kvgen cannot dequantize."""


class ContextLengthError(KvgenError):
    """A prompt (plus requested new tokens) that does not fit the context window."""
