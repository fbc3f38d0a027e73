"""The registry gate of the finetune-and-eval flow: by default a finetune is registered only
when it scores no worse than its base model; ``register_min_gain`` asks for a gain, or (empty)
registers always. The flow's end-to-end runs (tests/test_flows.py) check that a failed gate
completes the run, registers nothing and reports why."""

from __future__ import annotations

import pytest

from llmflow.flows.params import FinetuneEvalParams
from llmflow.flows.summary import summary_markdown
from llmflow.tasks.register import GATE_TAG, REASON_TAG, registry_gate


def test_by_default_only_a_model_no_worse_than_its_base_passes():
    default = FinetuneEvalParams().register_min_gain
    fell = registry_gate(0.26, 0.24, default)  # the nightly run that registered a regression
    assert not fell.passed
    assert fell.reason == "MMLU 0.2600 -> 0.2400 (-0.0200) is below the minimum gain +0.0000: not registered"
    assert fell.tags() == {GATE_TAG: "failed", REASON_TAG: fell.reason}
    assert registry_gate(0.25, 0.25, default).passed
    rose = registry_gate(0.24, 0.26, default)
    assert rose.passed and rose.tags()[GATE_TAG] == "passed"
    assert rose.reason == "MMLU 0.2400 -> 0.2600 (+0.0200) meets the minimum gain +0.0000"


def test_a_minimum_gain_is_met_exactly_and_always_registers_whatever_the_score():
    # 0.26 - 0.25 is 0.010000000000000009 and 0.03 - 0.02 is 0.009999999999999998 in floating point.
    assert registry_gate(0.25, 0.26, 0.01).passed and registry_gate(0.02, 0.03, 0.01).passed
    assert not registry_gate(0.57, 0.5799, 0.01).passed
    assert not registry_gate(0.25, 0.25, 0.01).passed
    assert registry_gate(0.30, 0.28, -0.05).passed  # a tolerated loss
    always = registry_gate(0.5, 0.1, None)
    assert always.passed and always.rule == "always" and always.tags()[GATE_TAG] == "off"
    assert always.reason == "MMLU 0.5000 -> 0.1000 (-0.4000); registered whatever the score"


def test_the_summary_says_why_nothing_was_registered():
    gate = registry_gate(0.26, 0.24, 0.0)
    markdown = summary_markdown("finetune-eval", {"mmlu_before": 0.26, "mmlu_after": 0.24, "registered": None,
                                                  "gate": gate.model_dump()}, "run-id")
    assert f"- registry gate (min_gain=0): failed: {gate.reason}\n" in markdown
    assert "- registered:" not in markdown


def test_the_summary_compares_every_benchmark_and_the_gate_names_its_own():
    gate = registry_gate(0.40, 0.45, 0.0, "BoolQ")
    assert gate.passed and gate.reason == "BoolQ 0.4000 -> 0.4500 (+0.0500) meets the minimum gain +0.0000"
    markdown = summary_markdown("finetune-eval", {"mmlu_before": 0.26, "mmlu_after": 0.24, "boolq_before": 0.4,
                                                  "boolq_after": 0.45, "gate": gate.model_dump()}, "run-id")
    assert "| MMLU | 0.2600 | 0.2400 | -0.0200 |\n| BoolQ | 0.4000 | 0.4500 | +0.0500 |\n" in markdown


def test_a_fall_of_more_than_two_standard_errors_of_the_change_is_a_regression():
    from llmflow.flows.comparison import compare, regression_tag

    scores = {"mmlu_before": 0.30, "mmlu_after": 0.40, "mmlu_after_stderr": 0.03,
              "boolq_before": 0.50, "boolq_after": 0.55, "boolq_after_stderr": 0.04}
    previous = {"mmlu_after": 0.52, "mmlu_after_stderr": 0.04, "boolq_after": 0.60}
    mmlu, boolq = compare(["mmlu", "boolq"], scores, previous, {"mmlu_after": 0.45})
    assert mmlu.change == pytest.approx(-0.12) and mmlu.change_stderr == pytest.approx(0.05)  # sqrt(.03² + .04²)
    assert mmlu.regression and mmlu.registered == 0.45
    assert boolq.change_stderr == pytest.approx(0.04) and not boolq.regression  # -0.05 within 2 x 0.04
    assert regression_tag([mmlu, boolq]) == "mmlu"
    (first,) = compare(["mmlu"], scores, {}, {})
    assert first.previous is None and first.change is None and not first.regression
    assert regression_tag([first]) == "none"
    from llmflow.flows.comparison import comparison_table

    markdown = summary_markdown("finetune-eval", {"comparison": comparison_table([mmlu, boolq])}, "run-id")
    assert "| MMLU | 0.3000 | 0.4000 | 0.4500 | 0.5200 | -0.1200 **regression** | 0.0500 |" in markdown
    assert "| BoolQ | 0.5000 | 0.5500 | - | 0.6000 | -0.0500 | 0.0400 |" in markdown
    assert "Regression since the previous run (more than two standard errors of the change): MMLU" in markdown


def test_the_summary_of_an_aligned_run_gives_the_heldout_rewards_before_and_after():
    result = {"mmlu_before": 0.26, "mmlu_after": 0.4, "method": "dpo", "heldout_pairs": 96.0,
              "reward_accuracy_before": 0.0, "reward_accuracy_after": 0.76, "reward_margin_before": 0.0,
              "reward_margin_after": 0.93, "sft_model": "/ws/models/sft", "reference": "/ws/logps/ref"}
    markdown = summary_markdown("finetune-eval", result, "run-id")
    assert ("Alignment (dpo) on 96 held-out preference pairs:\n\n| held-out pairs | before | after |\n|---|---|---|\n"
            "| reward accuracy | 0.0000 | 0.7600 |\n| reward margin | 0.0000 | 0.9300 |\n") in markdown
    assert "- sft_model: `/ws/models/sft`\n- reference: `/ws/logps/ref`\n" in markdown
    assert "Alignment" not in summary_markdown("finetune-eval", {"mmlu_before": 0.26, "mmlu_after": 0.4}, "run-id")

