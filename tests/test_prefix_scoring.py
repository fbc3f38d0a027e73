"""Shared-prefix scoring: a subject's few-shot prefix run once into a KV cache and each
question's own tokens on top of it gives the scores of running every prompt in full (within
1e-5 in fp32) and the same predictions, with either padding, any batch size, contexts
truncated to max_length, no shots, multi-token continuations and a chat template."""

from __future__ import annotations

import json

import pytest
import torch

from llmflow.data.templates import load_template
from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.engine import EvalConfig, evaluate, prompts_for, select_questions
from llmflow.evaluate.mmlu_data import load_mmlu
from llmflow.evaluate.prompts import CONTINUATIONS
from llmflow.evaluate.scoring import Request, model_requests, score_requests
from llmflow.weights import load_model

ATOL = 1e-5


@pytest.fixture(scope="module")
def sample(sample_assets):
    """The built-in sample assets (a tiny random Qwen2-style model): 3 subjects x (5 dev + 6 test)."""
    return sample_assets(test_questions=6, instruct_rows=40, documents=20)


@pytest.fixture(scope="module")
def model(sample):
    return load_model(sample / "model")[0].eval()


def subject_requests(sample, shots: int, template: str = "none") -> tuple[list[Request], list[str]]:
    data = load_mmlu(sample / "mmlu" / "hf")
    questions = select_questions(MMLU, data, None)
    prompts = prompts_for(MMLU, questions, data, shots)
    if template != "none":
        prompts = [load_template(sample / "model", template).prompt(p) for p in prompts]
    return model_requests(sample / "model", prompts, [CONTINUATIONS] * len(prompts)), [q.subject for q in questions]


_full_scores: dict[tuple, torch.Tensor] = {}


@torch.no_grad()
def full_prompt_scores(model, requests: list[Request], max_length: int = 1024) -> torch.Tensor:
    """Every (context, continuation) run alone through ``CausalLM.forward``, the last
    ``max_length`` tokens, continuation log-probabilities summed: nothing shared, nothing batched
    (kept for the module's later tests of the same requests)."""
    key = (id(model), max_length, tuple((tuple(r.context), tuple(map(tuple, r.continuations))) for r in requests))
    if key in _full_scores:
        return _full_scores[key]
    scores = _full_scores[key] = torch.empty(len(requests), 4)
    for i, r in enumerate(requests):
        for j, cont in enumerate(r.continuations):
            tokens = torch.tensor([(r.context + cont)[-(max_length + 1) :]])
            log_probs = torch.log_softmax(model(tokens[:, :-1]).float(), dim=-1)[0, -len(cont) :]
            scores[i, j] = log_probs.gather(1, torch.tensor(cont)[:, None]).sum()
    return scores


def assert_same(shared: torch.Tensor, full: torch.Tensor) -> None:
    assert (shared - full).abs().max().item() <= ATOL
    assert shared.argmax(1).tolist() == full.argmax(1).tolist()


class ForwardLog:
    """Records the token shape of every decoder forward and whether it wrote a KV cache."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[tuple[int, ...], bool]] = []
        self.handle = model.model.register_forward_pre_hook(self.hook, with_kwargs=False)

    def hook(self, module, args) -> None:
        cache = args[3] if len(args) > 3 else None
        self.calls.append((tuple(args[0].shape), cache is not None))


@pytest.mark.parametrize(("padding_side", "batch_size"), [("right", 1), ("left", 3), ("right", 18), ("left", 18)])
def test_shared_prefix_scores_equal_full_prompts(sample, model, padding_side, batch_size):
    requests, subjects = subject_requests(sample, shots=5)
    shared, fast = score_requests(model, requests, batch_size, 1024, padding_side, groups=subjects)
    assert all(fast)
    assert_same(shared, full_prompt_scores(model, requests))


def test_the_prefix_runs_once_per_subject(sample, model):
    requests, subjects = subject_requests(sample, shots=5)
    log = ForwardLog(model)
    try:
        score_requests(model, requests, 4, 1024, groups=subjects)
    finally:
        log.handle.remove()
    prefixes = [shape for shape, _ in log.calls if shape[0] == 1]
    assert len(prefixes) == 3  # one per subject, batch of one
    run = sum(shape[0] * shape[1] for shape, _ in log.calls)
    full = sum(len(r.context) for r in requests)
    prompt_tokens = full / len(requests)
    # The 5-shot prefix is most of each prompt: the tokens run (prefixes once, padding
    # included) are a fraction of the prompts' tokens.
    assert min(s[1] for s in prefixes) > 0.6 * prompt_tokens
    assert run < 0.5 * full
    assert all(cached for shape, cached in log.calls if shape[0] > 1 or shape not in prefixes)


def test_contexts_longer_than_max_length_run_truncated_in_full(sample, model):
    requests, subjects = subject_requests(sample, shots=5)
    lengths = sorted(len(r.context) for r in requests)
    max_length = lengths[len(lengths) // 2]  # about half the contexts are cut on the left
    assert lengths[0] < max_length < lengths[-1]
    shared, _ = score_requests(model, requests, 3, max_length, groups=subjects)
    assert_same(shared, full_prompt_scores(model, requests, max_length))


def test_zero_shots(sample, model):
    requests, subjects = subject_requests(sample, shots=0)
    shared, _ = score_requests(model, requests, 5, 1024, "left", groups=subjects)
    assert_same(shared, full_prompt_scores(model, requests))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_multi_token_continuations_under_a_chat_template(sample, model, padding_side):
    # The chat prompt ends in a newline, which moves into the continuation ("\n A": several tokens).
    requests, subjects = subject_requests(sample, shots=2, template="tokenizer")
    assert not any(r.single_token for r in requests)
    shared, fast = score_requests(model, requests, 5, 1024, padding_side, groups=subjects)
    assert not any(fast)
    assert_same(shared, full_prompt_scores(model, requests))


def test_one_request_per_group_and_mixed_paths(sample, model):
    requests, subjects = subject_requests(sample, shots=3)
    # A multi-token question among one-token ones, and a subject with a single question.
    requests[1] = Request(requests[1].context, [c + c for c in requests[1].continuations])
    groups = [*subjects[:-1], "alone"]
    shared, fast = score_requests(model, requests, 4, 1024, groups=groups)
    assert fast[1] is False and sum(fast) == len(requests) - 1
    assert_same(shared, full_prompt_scores(model, requests))


def test_evaluate_shares_the_prefix_by_default(sample, tmp_path):
    common = {"model": sample / "model", "data": sample / "mmlu" / "hf", "shots": 5, "batch_size": 4}
    assert EvalConfig(out=tmp_path / "x", **common).shared_prefix is True
    shared = evaluate(MMLU, EvalConfig(out=tmp_path / "shared", **common))
    full = evaluate(MMLU, EvalConfig(out=tmp_path / "full", shared_prefix=False, **common))
    rows = [[json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()] for out in (shared, full)]
    assert [r["prediction"] for r in rows[0]] == [r["prediction"] for r in rows[1]]
    assert_same(torch.tensor([r["scores"] for r in rows[0]]), torch.tensor([r["scores"] for r in rows[1]]))
