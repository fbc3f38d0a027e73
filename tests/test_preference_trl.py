"""llmflow.train.preference against TRL 1.16's own trainers on the same tiny random Llama (fp32).

TRL's side runs its real code path: ``DPOTrainer`` (loss_type sigmoid, ipo, robust),
``CPOTrainer(loss_type="simpo", cpo_alpha=0)`` and ``ORPOTrainer`` are constructed on a
transformers ``LlamaForCausalLM`` with an in-memory text dataset and a word-level tokenizer
(one word per token id, so the text round-trips to the ids below); each trainer tokenizes the
dataset itself, its own collator builds the batch, and its loss function
(``DPOTrainer.compute_loss``, ``get_batch_loss_metrics`` of the other two) computes the loss,
the metrics and, through ``backward``, the gradients. Our side packs the ids drawn (TRL's
tokenized dataset and collated batch are checked to hold exactly these, EOS appended to each
response, no BOS) into preference rows (chosen | rejected | padding documents; one row with
two pairs) and runs them through ``CausalLM`` loaded from the same checkpoint and the
functions of ``llmflow.train.preference``.

DPO trains a policy moved away from its reference (the checkpoint plus noise; TRL gets the
reference model explicitly), so its log-ratios are not zero. The LoRA case lets TRL wrap the
checkpoint with PEFT (``peft_config``): its reference is the model with adapters disabled,
ours the base checkpoint; the adapters get nonzero ``lora_B`` so the two differ.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_frontier_flows import FAMILIES as FRONTIER

from llmflow.data.instruction_dataset import next_token_targets
from llmflow.models import LoraConfig, apply_lora
from llmflow.train.preference import (
    PreferenceConfig,
    document_sums,
    nll_weight,
    pair_documents,
    pair_logps,
    pair_terms,
)
from llmflow.weights import load_hf_model, save_hf_model

# TRL's DPOTrainer reads transformers' deprecated ``is_gradient_checkpointing``.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

LOSS_ATOL = 1e-5
"""Largest |loss difference| allowed (fp32; losses ~0.1-5)."""
REWARD_ATOL = 1e-5
"""Largest |difference| of TRL's rewards/chosen, rewards/rejected (batch means) and of the
per-pair log-probs."""
GRAD_ATOL = 1e-5
"""Largest |difference| of any parameter's gradient element."""

PAD, IM_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VOCAB = 160  # conftest's TINY vocabulary
BETA = 0.1
SEED = 0

# (prompt, chosen, rejected) lengths: shared prompts of different lengths, responses of
# different lengths (the rejected one longer in some pairs, shorter in others).
LENGTHS = [(5, 4, 7), (3, 6, 2), (8, 1, 3), (2, 5, 5)]
ROWS = [[0], [1, 2], [3]]
"""Pairs per preference row: row 1 packs two pairs (documents 0-3, padding 4)."""

CASES = {
    "dpo-sigmoid": ("dpo", {"loss_type": "sigmoid"}),
    # IPO's loss is (per-token margin - 1 / (2 beta))^2: ~25 at beta 0.1, where one fp32 ulp is
    # 2e-6 and our and TRL's log-prob sums (1 ulp apart) already differ by ~6e-6 in the loss;
    # at beta 0.5 the loss is ~1 and the same check keeps its margin.
    "dpo-ipo": ("dpo", {"loss_type": "ipo", "beta": 0.5}),
    "dpo-robust": ("dpo", {"loss_type": "robust", "label_smoothing": 0.1}),
    "simpo": ("simpo", {"simpo_gamma": 0.5}),
    "orpo": ("orpo", {}),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK, LORA_ALPHA = 4, 8.0


def word_tokenizer():
    """A word-level tokenizer over VOCAB ids: the three Qwen special tokens (pad 0, eos 2)
    and words "w3" ... "w159"; split on whitespace, special tokens split out anywhere."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, IM_START: 1, EOS: 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([PAD, IM_START, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


class Setup:
    """What every case shares: tokenizer, pairs, the HF models and our models."""

    def __init__(self, make_hf_model, out_dir, family: str = "llama", **overrides):
        self.out_dir = out_dir
        self.tokenizer = word_tokenizer()
        self.eos = self.tokenizer.eos_token_id
        g = torch.Generator().manual_seed(SEED)

        def draw(n: int) -> list[int]:
            return torch.randint(3, VOCAB, (n,), generator=g).tolist()

        self.pairs = [(draw(p), draw(c), draw(r)) for p, c, r in LENGTHS]
        # TRL adds EOS to each response; the text leaves it off.
        self.texts = {
            "prompt": [words(p) for p, _, _ in self.pairs],
            "chosen": [" " + words(c) for _, c, _ in self.pairs],
            "rejected": [" " + words(r) for _, _, r in self.pairs],
        }
        self.reference_hf, path = make_hf_model(family, seed=SEED, **overrides)
        self.policy_hf = copy.deepcopy(self.reference_hf)
        with torch.no_grad():
            for p in self.policy_hf.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        policy_path = out_dir / "policy"
        self.policy_hf.save_pretrained(policy_path)
        self.reference = load_hf_model(path).eval()
        self.policy_path = policy_path
        self.path = path
        self.rows = self.pack()

    def sequences(self) -> list[tuple[list[int], list[int], int]]:
        """Per pair: the chosen and rejected sequences (prompt + response + EOS), prompt length."""
        return [(p + c + [self.eos], p + r + [self.eos], len(p)) for p, c, r in self.pairs]

    def pack(self) -> dict[str, torch.Tensor]:
        """Preference rows of ``ROWS``: ids, document ids, response targets (-100 on prompt
        positions, every document's last position and padding) and full targets (every next
        token inside a document: the NLL over prompt and response)."""
        seqs = self.sequences()
        docs = [[(ids, seqs[k][2]) for k in row for ids in seqs[k][:2]] for row in ROWS]
        length = max(sum(len(ids) for ids, _ in row) for row in docs)
        n = len(docs)
        input_ids = np.full((n, length), self.tokenizer.pad_token_id, dtype=np.int64)
        labels = np.full((n, length), -100, dtype=np.int64)
        full = np.full((n, length), -100, dtype=np.int64)
        document_ids = np.zeros((n, length), dtype=np.int64)
        for b, row in enumerate(docs):
            pos = 0
            for d, (ids, prompt) in enumerate(row):
                input_ids[b, pos : pos + len(ids)] = ids
                full[b, pos : pos + len(ids)] = ids
                labels[b, pos + prompt : pos + len(ids)] = ids[prompt:]
                document_ids[b, pos : pos + len(ids)] = d
                pos += len(ids)
            document_ids[b, pos:] = len(row)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "document_ids": torch.from_numpy(document_ids),
            "targets": torch.from_numpy(next_token_targets(labels, document_ids)),
            "full_targets": torch.from_numpy(next_token_targets(full, document_ids)),
        }


@pytest.fixture(scope="module")
def setup(make_hf_model, tmp_path_factory) -> Setup:
    return Setup(make_hf_model, tmp_path_factory.mktemp("preference_trl"))


def dataset(setup: Setup):
    from datasets import Dataset

    return Dataset.from_dict(setup.texts)


def common_args(setup: Setup) -> dict:
    return {
        "output_dir": str(setup.out_dir / "trl"),
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,  # TRL's default is on; the gradients are the same either way
        "per_device_train_batch_size": len(setup.pairs),
        "seed": SEED,
    }


# --- our side ------------------------------------------------------------------------------


def our_objective(setup: Setup, method: str, config: PreferenceConfig, policy, reference=None):
    """(objective, PairTerms, policy PairLogps, reference PairLogps, chosen NLL) of the rows."""
    rows = setup.rows
    response = rows["targets"] != -100

    def logps(model):
        ce = model(rows["input_ids"], labels=rows["full_targets"], document_ids=rows["document_ids"],
                   loss_reduction="none")
        documents = pair_documents(rows["document_ids"])
        sums = document_sums(-ce, response, rows["document_ids"], documents)
        counts = document_sums(torch.ones_like(ce), response, rows["document_ids"], documents)
        return pair_logps(sums, counts)[0], ce

    policy_logps, ce = logps(policy)
    ref_logps = None
    if reference is not None:
        with torch.no_grad():
            ref_logps = logps(reference)[0]
    terms = pair_terms(method, config, policy_logps, ref_logps)
    assert terms.losses.shape == (len(setup.pairs),)
    # The chosen sequences' NLL over prompt and response: even documents, every next-token
    # target (padding, an even document in some rows, has none).
    chosen = (rows["document_ids"] % 2 == 0) & (rows["full_targets"] != -100)
    nll = (ce * chosen).sum() / chosen.sum()
    objective = terms.losses.sum() / len(setup.pairs) + nll_weight(method) * nll
    return objective, terms, policy_logps, ref_logps, nll


# --- checks --------------------------------------------------------------------------------


def assert_close(actual, expected, atol, what):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"{what}: max |difference| {diff:.3e} > {atol:.0e}"
    return diff


def assert_grads_close(hf_named, ours_named, atol) -> float:
    hf_grads = {name: p.grad for name, p in hf_named if p.requires_grad}
    ours_grads = {name: p.grad for name, p in ours_named if p.requires_grad}
    assert set(hf_grads) == set(ours_grads) and hf_grads
    worst = 0.0
    for name, grad in hf_grads.items():
        assert grad is not None and ours_grads[name] is not None, name
        assert grad.abs().max() > 0, f"{name}: zero gradient"
        worst = max(worst, assert_close(ours_grads[name], grad, atol, f"gradient of {name}"))
    return worst


def check_dpo_tokens(setup: Setup, trainer, batch) -> None:
    """TRL tokenized exactly our ids, and its batch holds our documents."""
    data = trainer.train_dataset
    for k, (p, c, r) in enumerate(setup.pairs):
        assert data[k]["prompt_ids"] == p
        assert data[k]["chosen_ids"] == c + [setup.eos]
        assert data[k]["rejected_ids"] == r + [setup.eos]
    n = len(setup.pairs)
    for k, (chosen, rejected, prompt) in enumerate(setup.sequences()):
        for row, ids in ((k, chosen), (n + k, rejected)):
            assert batch["input_ids"][row, : len(ids)].tolist() == ids
            assert batch["attention_mask"][row].sum() == len(ids)
            assert batch["completion_mask"][row].tolist()[: len(ids)] == [0] * prompt + [1] * (len(ids) - prompt)


def check_paired_tokens(setup: Setup, trainer, batch) -> None:
    """CPO's and ORPO's tokenization: the same ids; labels -100 on the prompt; no BOS added."""
    assert trainer.processing_class.bos_token_id is None
    for k, (chosen, rejected, prompt) in enumerate(setup.sequences()):
        for side, ids in (("chosen", chosen), ("rejected", rejected)):
            assert batch[f"{side}_input_ids"][k, : len(ids)].tolist() == ids
            assert batch[f"{side}_labels"][k, : len(ids)].tolist() == [-100] * prompt + ids[prompt:]
            assert (batch[f"{side}_labels"][k, len(ids) :] == -100).all()


def trl_dpo_trainer(setup: Setup, overrides: dict, model, ref_model=None, peft_config=None):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(**common_args(setup), **{"beta": BETA, **overrides})
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=dataset(setup),
                      processing_class=setup.tokenizer, peft_config=peft_config)


def dpo_batch(setup: Setup, trainer):
    batch = trainer.data_collator([trainer.train_dataset[k] for k in range(len(setup.pairs))])
    check_dpo_tokens(setup, trainer, batch)
    return trainer._prepare_inputs(batch)


def dpo_metric(trainer, name: str) -> float:
    return trainer._metrics["train"][name][-1]


def report(case: str, diffs: dict) -> None:
    print(f"{case}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


# --- the cases -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_objective_matches_trl(case, setup):
    method, settings = CASES[case]
    settings = {"beta": BETA, **settings}
    config = PreferenceConfig(**settings)
    policy_hf = copy.deepcopy(setup.policy_hf).train()
    ours = load_hf_model(setup.policy_path).train()
    diffs = {}

    if method == "dpo":
        trainer, loss, metrics, objective, terms, policy_logps = dpo_side_by_side(setup, settings, config, policy_hf,
                                                                                 ours, diffs)
    else:
        if method == "simpo":
            from trl.experimental.cpo import CPOConfig, CPOTrainer

            args = CPOConfig(**common_args(setup), beta=config.beta, loss_type="simpo", cpo_alpha=0.0,
                             simpo_gamma=config.simpo_gamma, max_length=512)
            trainer = CPOTrainer(model=policy_hf, args=args, train_dataset=dataset(setup),
                                 processing_class=setup.tokenizer)
        else:
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            args = ORPOConfig(**common_args(setup), beta=config.beta, max_length=512)
            trainer = ORPOTrainer(model=policy_hf, args=args, train_dataset=dataset(setup),
                                  processing_class=setup.tokenizer)
        batch = trainer.data_collator([trainer.train_dataset[k] for k in range(len(setup.pairs))])
        check_paired_tokens(setup, trainer, batch)
        batch = trainer._prepare_inputs(batch)
        with torch.no_grad():
            chosen_avg, rejected_avg = trainer.concatenated_forward(trainer.model, batch)[:2]
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
        objective, terms, policy_logps, _, nll = our_objective(setup, method, config, ours)
        diffs["logps"] = max(
            assert_close(policy_logps.chosen / policy_logps.chosen_tokens, chosen_avg, REWARD_ATOL, "chosen logps"),
            assert_close(policy_logps.rejected / policy_logps.rejected_tokens, rejected_avg, REWARD_ATOL,
                         "rejected logps"),
        )
        if method == "orpo":
            diffs["nll"] = assert_close(nll, metrics["nll_loss"], LOSS_ATOL, "ORPO's chosen NLL")

    check_objective(policy_logps, objective, loss, terms, metrics, diffs)
    loss.backward()
    objective.backward()
    diffs["gradients"] = assert_grads_close(trainer.model.named_parameters(), ours.named_parameters(), GRAD_ATOL)
    report(case, diffs)


def dpo_side_by_side(setup: Setup, settings: dict, config: PreferenceConfig, policy_hf, ours, diffs: dict):
    """TRL's DPO loss and metrics on the policy ``policy_hf``, and ours on ``ours`` (the same
    weights), their reference log-probs compared into ``diffs``."""
    trainer = trl_dpo_trainer(setup, settings, policy_hf, ref_model=copy.deepcopy(setup.reference_hf))
    batch = dpo_batch(setup, trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.ref_model, batch)
    metrics = {name: dpo_metric(trainer, name)
               for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")}
    objective, terms, policy_logps, ref_logps, _ = our_objective(setup, "dpo", config, ours, setup.reference)
    diffs["reference logps"] = max(assert_close(ref_logps.chosen, ref_chosen, REWARD_ATOL, "reference chosen logps"),
                                   assert_close(ref_logps.rejected, ref_rejected, REWARD_ATOL,
                                                "reference rejected logps"))
    assert terms.chosen_rewards.abs().min() > 1e-3, "the policy is still the reference"
    diffs["logps"] = max(assert_close(policy_logps.chosen.mean(), metrics["logps/chosen"], REWARD_ATOL, "logps"),
                         assert_close(policy_logps.rejected.mean(), metrics["logps/rejected"], REWARD_ATOL, "logps"))
    return trainer, loss, metrics, objective, terms, policy_logps


def check_objective(policy_logps, objective, loss, terms, metrics: dict, diffs: dict) -> None:
    """Our token counts, loss and rewards against TRL's, into ``diffs``."""
    # Per-pair token counts: each response's tokens and its EOS.
    counts = torch.tensor([[c + 1, r + 1] for _, c, r in LENGTHS], dtype=torch.float32)
    torch.testing.assert_close(torch.stack([policy_logps.chosen_tokens, policy_logps.rejected_tokens], 1), counts)
    diffs["loss"] = assert_close(objective.detach(), loss.detach(), LOSS_ATOL, "loss")
    diffs["rewards"] = max(
        assert_close(terms.chosen_rewards.mean(), metrics["rewards/chosen"], REWARD_ATOL, "rewards/chosen"),
        assert_close(terms.rejected_rewards.mean(), metrics["rewards/rejected"], REWARD_ATOL, "rewards/rejected"),
    )


@pytest.mark.parametrize("family", list(FRONTIER))
def test_dpo_matches_trl_on_the_frontier_families(family, make_hf_model, tmp_path):
    """DPO (sigmoid) on each frontier family against TRL's DPOTrainer on transformers' model of
    the family: DeepSeek-V3's latent attention and group-limited experts, GLM-4.5, gpt-oss's
    sinks and biased experts, Gemma 3's sliding window (shorter than the packed rows) and
    soft-capped logits. Our gradients are compared in transformers' layout: written as a
    checkpoint by ``save_hf_model`` and read back by transformers (its fused experts)."""
    from transformers import AutoModelForCausalLM

    setup = Setup(make_hf_model, tmp_path, family, **FRONTIER[family])
    config = PreferenceConfig(beta=BETA)
    ours = load_hf_model(setup.policy_path).train()
    diffs = {}
    # TRL adds gpt-oss's load-balancing loss at its defaults (llmflow: when config.json trains it,
    # docs/training.md); the objectives compared here are DPO's alone.
    settings = {"beta": BETA, "loss_type": "sigmoid", "router_aux_loss_coef": 0.0}
    trainer, loss, metrics, objective, terms, policy_logps = dpo_side_by_side(
        setup, settings, config, copy.deepcopy(setup.policy_hf).train(), ours, diffs)
    check_objective(policy_logps, objective, loss, terms, metrics, diffs)
    loss.backward()
    objective.backward()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(p.grad)
    gradients = AutoModelForCausalLM.from_pretrained(save_hf_model(ours, tmp_path / "gradients"), dtype=torch.float32)
    diffs["gradients"] = assert_grads_close(trainer.model.named_parameters(), as_gradients(gradients), GRAD_ATOL)
    report(f"dpo-{family}", diffs)


def as_gradients(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``model``'s parameters with each one's value as its gradient (for ``assert_grads_close``)."""
    named = list(model.named_parameters())
    for _, p in named:
        p.grad = p.detach()
    return named


def test_lora_dpo_matches_trl_peft(setup):
    """TRL's PEFT path (``peft_config``, reference = adapters disabled) against llmflow's
    ``apply_lora`` with the same adapter values and the base checkpoint as reference."""
    from peft import LoraConfig as PeftLoraConfig

    config = PreferenceConfig(beta=BETA)
    peft_config = PeftLoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                 task_type="CAUSAL_LM")
    trainer = trl_dpo_trainer(setup, {"loss_type": "sigmoid"}, copy.deepcopy(setup.reference_hf).train(),
                              peft_config=peft_config)
    assert trainer.ref_model is None  # the reference is the model with its adapters disabled

    ours = load_hf_model(setup.path).train()
    adapted = apply_lora(ours, LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=LORA_TARGETS))
    assert len(adapted) == 7 * setup.reference.config.num_hidden_layers
    g = torch.Generator().manual_seed(SEED + 1)
    peft_names = {}
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" not in name:
                assert not p.requires_grad, name
                continue
            if "lora_B" in name:  # PEFT starts it at zero: give the adapters an effect
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            ours_name = name.removeprefix("base_model.model.").replace(".default.", ".")
            ours.get_parameter(ours_name).copy_(p)
            peft_names[name] = ours_name
    assert len(peft_names) == 2 * len(adapted)

    batch = dpo_batch(setup, trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    objective, terms, _, _, _ = our_objective(setup, "dpo", config, ours, setup.reference)
    assert terms.chosen_rewards.abs().min() > 1e-3, "the adapters changed nothing"
    diffs = {
        "loss": assert_close(objective.detach(), loss.detach(), LOSS_ATOL, "loss"),
        "rewards": max(
            assert_close(terms.chosen_rewards.mean(), dpo_metric(trainer, "rewards/chosen"), REWARD_ATOL,
                         "rewards/chosen"),
            assert_close(terms.rejected_rewards.mean(), dpo_metric(trainer, "rewards/rejected"), REWARD_ATOL,
                         "rewards/rejected"),
        ),
    }
    loss.backward()
    objective.backward()
    hf_named = [(peft_names[name], p) for name, p in trainer.model.named_parameters() if name in peft_names]
    diffs["gradients"] = assert_grads_close(hf_named, ours.named_parameters(), GRAD_ATOL)
    report("lora-dpo", diffs)
