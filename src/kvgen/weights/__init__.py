"""Loading parameters from GGUF files and Hugging Face checkpoint directories."""
