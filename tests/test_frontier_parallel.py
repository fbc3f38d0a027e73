"""Tensor, expert and context parallelism for the frontier families (tiny, shaped as in
``test_frontier_flows``, over the sample's data): DeepSeek-V3's Multi-head Latent Attention
split by heads after its replicated down projections (tp) and under Ulysses (cp), GLM-4.5's
q/k norms and group-limited routing, gpt-oss's sinks split with the heads (tp) and under ring
attention (cp) and its biased experts split over the ranks (ep). Each layout trains on four
ranks (tp=2 or cp=2, with dp=2 x ep=2) what one process does: losses, gradient norms, both
auxiliary losses and the experts' load within ``TOLERANCES``, with DeepSeek's sequence-wise
loss and the auxiliary-loss-free bias update on; and a DeepSeek-V3 checkpoint saved at
tp=2 x ep=2 resumes in one process on the steps the single run took.

Ulysses and ring for each attention (sinks and latent attention both) are compared to one
process in-process, logits and gradients, by ``test_context_parallel``."""

from __future__ import annotations

import pytest
from forked_workers import train_forked
from test_frontier_flows import FAMILIES
from train_helpers import assert_same, config, resume_from, step_metrics, training_assets

pytestmark = pytest.mark.slow

# The step line prints gradient norms to 4 decimals: a 1e-6 difference can move the last digit.
TOLERANCES = {"loss": 1e-5, "grad_norm": 1.5e-4, "moe_aux_loss": 1e-5, "moe_seq_aux_loss": 1e-5,
              "max_expert_load": 0.01}
ROUTING = {"router_aux_loss_coef": 0.02, "router_seq_aux_loss_coef": 0.01, "router_bias_update_rate": 0.01}
"""Every routing option a family has: gpt-oss has no correction bias, so no sequence-wise loss
nor bias update either (they are DeepSeek's)."""
LAYOUTS = {
    "deepseek_v3": {"tp": {"tp": 2}, "cp": {"cp": 2, "cp_algo": "ulysses"}},
    "glm4_moe": {"tp": {"tp": 2}, "cp": {"cp": 2, "cp_algo": "ring"}},
    "gpt_oss": {"tp": {"tp": 2}, "cp": {"cp": 2, "cp_algo": "ring"}},
}


@pytest.fixture(scope="module")
def data(sample_assets, tmp_path_factory):
    return training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("frontier"))


def train(data, model, out, nproc: int = 1, **overrides) -> dict[int, dict[str, float]]:
    cfg = config({**data, "model": model}, out, **{"steps": 4, **overrides})
    return step_metrics(train_forked(cfg, nproc, env={"OMP_NUM_THREADS": "1"}), TOLERANCES)


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_tp_ep_and_cp_train_what_one_process_does(family, data, sample_tokenizer_model, tmp_path):
    model = sample_tokenizer_model(family, **FAMILIES[family])
    routing = {"router_aux_loss_coef": ROUTING["router_aux_loss_coef"]} if family == "gpt_oss" else ROUTING
    one = train(data, model, tmp_path / "one", micro_batch_size=4, **routing)
    assert sorted(one) == [1, 2, 3, 4] and one[1]["moe_aux_loss"] > 0
    assert ("moe_seq_aux_loss" in one[1]) == (family != "gpt_oss")
    for name, layout in LAYOUTS[family].items():
        split = train(data, model, tmp_path / name, nproc=4, dp=2, ep=2, micro_batch_size=2, save_interval=2,
                      **layout, **routing)
        assert sorted(split) == [1, 2, 3, 4], name
        assert_same(split, one, TOLERANCES)
    if family == "deepseek_v3":
        resume_from(tmp_path / "tp", 2)
        resumed = train(data, model, tmp_path / "tp", micro_batch_size=4, **routing)
        assert sorted(resumed) == [3, 4]
        assert_same(resumed, one, TOLERANCES)
