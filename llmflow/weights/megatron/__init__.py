"""Megatron-LM / MindSpeed-LLM checkpoints: reading them into llmflow's checkpoints
(``llmflow convert --megatron``) and writing llmflow's as theirs (``llmflow export --megatron``)."""
