"""Evaluation of models on multiple-choice benchmarks (MMLU, C-Eval, CMMLU), prompted and
scored as lm-evaluation-harness does it."""
