"""Model architecture specs, our decoder, checkpoint I/O and tokenizers."""
