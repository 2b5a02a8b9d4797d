"""Error classes raised at kvgen's boundaries.

Every user-facing error is a ``KvgenError``, which subclasses ``ValueError`` so
callers that catch ``ValueError`` keep working. The CLI turns any of these into
one line on stderr and exit code 2.
"""


class KvgenError(ValueError):
    """Base class of every error kvgen raises for bad input."""


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
