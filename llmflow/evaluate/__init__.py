"""Evaluation of models on multiple-choice benchmarks (MMLU), scored as
lm-evaluation-harness scores them."""
