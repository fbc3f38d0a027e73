"""Data formats and tokenization stages."""
