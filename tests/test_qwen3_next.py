"""Qwen3-Next and Qwen3.5 (hybrid Gated DeltaNet / gated attention layers) against transformers
on tiny random weights (fp32, eager attention; transformers runs its own torch gated delta
rule and convolution, flash-linear-attention and causal-conv1d not being installed): logits,
packed documents, greedy generation with the linear layers' states in the cache, the
checkpoint and config round trip, and a multimodal Qwen3.5 checkpoint whose vision tower is
left out. Also the reference gated delta rule and convolution against transformers' own."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_generate import VOCAB, add_tokenizer, hf_greedy

import llmflow.kernels as K
from llmflow.data.tokenizer import load_tokenizer
from llmflow.infer.generate import GenerateConfig, generate
from llmflow.models import ModelConfig
from llmflow.models.blocks.gated_deltanet import GatedDeltaNet
from llmflow.models.blocks.moe import MoE
from llmflow.weights import load_hf_model, load_model, save_hf_model
from llmflow.weights.hf import hf_config_dict

ATOL = 1e-5
BATCH, SEQ = 2, 32

# Linear heads: 2 query/key heads, each serving 2 value heads; head widths 16.
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
HYBRID = {**LINEAR, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16}
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48}
CASES = {
    # layers 0-2 linear, 3 attention (full_attention_interval 4); layer 1 dense (mlp_only_layers)
    "qwen3_next_moe": ("qwen3_next", {**HYBRID, **EXPERTS, "mlp_only_layers": [1]}),
    "qwen3_next_dense_tied": ("qwen3_next", {**HYBRID, "num_experts": 0, "tie_word_embeddings": True,
                                             "layer_types": ["linear_attention", "full_attention"] * 2}),
    "qwen3_5_text": ("qwen3_5_text", {**HYBRID, "num_key_value_heads": 1}),
    "qwen3_5_text_tied": ("qwen3_5_text", {**HYBRID, "tie_word_embeddings": True, "attention_bias": True}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {**HYBRID, **EXPERTS}),
}


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def hf_model(make_hf_model, case, **extra):
    family, overrides = CASES[case]
    return make_hf_model(family, **overrides, **extra)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, make_hf_model, tokens):
    hf, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path).eval()
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits)
    kinds = [type(getattr(layer, layer.mixer_name)).__name__ for layer in ours.model.layers.values()]
    assert kinds == ["GatedDeltaNet" if t == "linear_attention" else "Attention" for t in hf.config.layer_types]
    routed = [int(n) for n, layer in ours.model.layers.items() if isinstance(layer.mlp, MoE)]
    assert routed == [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert ours.model.inv_freq.shape == (int(16 * 0.25) // 2,)
    if hf.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_reference_kernels_match_transformers_torch_paths():
    """The gated delta rule (against transformers' chunked and recurrent forms, a state carried
    over) and the causal convolution (against F.conv1d as transformers runs it)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as M

    g = torch.Generator().manual_seed(0)
    b, s, h, dk, dv = 2, 20, 4, 8, 12
    q, k, v = torch.randn(b, s, h, dk, generator=g), torch.randn(b, s, h, dk, generator=g), torch.randn(b, s, h, dv, generator=g)
    decay, beta = -2 * torch.rand(b, s, h, generator=g), torch.rand(b, s, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    for rule in (M.torch_chunk_gated_delta_rule, M.torch_recurrent_gated_delta_rule):
        expected, expected_state = rule(q, k, v, decay, beta, initial_state=state, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
        out, final = K.gated_delta_rule(q, k, v, decay, beta, initial_state=state, output_final_state=True)
        assert_close(out, expected, atol=2e-6)
        assert_close(final, expected_state, atol=2e-6)
    x, weight = torch.randn(b, s, 24, generator=g), torch.randn(24, 4, generator=g)
    expected = M.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    out, final = K.causal_conv1d(x, weight, output_final_state=True)
    assert_close(out, expected, atol=1e-6)
    assert torch.equal(final, x[:, -3:].transpose(1, 2))
    # Run in two pieces, the second from the first's state: the same as in one.
    head, state1 = K.causal_conv1d(x[:, :7], weight, output_final_state=True)
    tail, _ = K.causal_conv1d(x[:, 7:], weight, state=state1)
    assert_close(torch.cat([head, tail], dim=1), out, atol=1e-6)
    first, rec = K.gated_delta_rule(q[:, :7], k[:, :7], v[:, :7], decay[:, :7], beta[:, :7], output_final_state=True)
    rest, _ = K.gated_delta_rule(q[:, 7:], k[:, 7:], v[:, 7:], decay[:, 7:], beta[:, 7:], initial_state=rec)
    whole, _ = K.gated_delta_rule(q, k, v, decay, beta)
    assert_close(torch.cat([first, rest], dim=1), whole, atol=1e-6)


@pytest.mark.parametrize("case", ["qwen3_next_moe", "qwen3_5_text_tied"])
def test_packed_documents_equal_separate_forward_passes(case, make_hf_model, tokens):
    hf, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path).eval()
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 9]])
    ids = tokens(2, docs.shape[1], seed=3)
    checked = 0
    with torch.no_grad():
        packed = ours(ids, document_ids=docs)
        for b in range(2):
            for d in docs[b].unique():
                idx = (docs[b] == d).nonzero().squeeze(1)
                assert_close(packed[b : b + 1, idx], hf(ids[b : b + 1, idx]).logits)
                assert_close(packed[b : b + 1, idx], ours(ids[b : b + 1, idx]))
                checked += 1
        assert checked == 6
        # Without document ids the later documents see the earlier ones, through every linear layer too.
        assert (ours(ids)[0, 5:] - packed[0, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["qwen3_next_moe", "qwen3_5_text", "qwen3_5_moe_text"])
def test_greedy_generation_matches_transformers(case, make_hf_model):
    """Left-padded prompts of 7, 3, 12 and 1 tokens (the one-token prompt shorter than the
    convolution's window): each row generates what transformers generates for it alone, and
    what llmflow generates for it alone."""
    family, overrides = CASES[case]
    hf, path = make_hf_model(family, **{**overrides, "vocab_size": VOCAB})
    add_tokenizer(path)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12, 1)]
    eos = 5
    config = GenerateConfig(max_new_tokens=10, eos_token_ids=[eos])
    batched = [r.tokens for r in generate(model, tokenizer, prompts, config)]
    alone = [hf_greedy(hf, [p], 10, eos)[0] for p in prompts]
    assert batched == alone
    assert batched == [generate(model, tokenizer, [p], config)[0].tokens for p in prompts]


def test_a_shared_prefix_with_left_padding_scores_like_whole_rows(make_hf_model, tokens):
    """Evaluation's shared prefix: the prefix once, then left-padded rows after it (their pads
    pass the linear layers' states by), scores equal to running each row whole."""
    from llmflow.evaluate.prefix_forward import Row, run_rows

    _, path = hf_model(make_hf_model, "qwen3_5_text")
    model = load_hf_model(path).eval()
    prefix = tokens(1, 6, seed=4)[0].tolist()
    rows = [Row(tokens(1, n, seed=n)[0].tolist(), [[(i, 7)] for i in range(n)]) for n in (5, 2, 9)]
    whole = [Row(prefix + r.tokens, [[(len(prefix) + i, t) for i, t in s] for s in r.targets]) for r in rows]
    expected = run_rows(model, whole, batch_size=1)
    for side in ("left", "right"):
        got = run_rows(model, rows, batch_size=3, padding_side=side, prefix=prefix)
        for a, b in zip(got, expected, strict=True):
            assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_and_config_round_trip_bit_exact(case, make_hf_model, tmp_path):
    _, path = hf_model(make_hf_model, case)
    ours = load_hf_model(path)
    saved = save_hf_model(ours, tmp_path / "out")
    original, written = load_file(path / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((saved / "config.json").read_text()) == json.loads((path / "config.json").read_text())
    if case.startswith("qwen3_next_moe") or case == "qwen3_5_moe_text":
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in written


def test_transformers4_qwen3_next_config_is_read(make_hf_model, tokens):
    """Qwen3-Next as its Hub config.json spells it (transformers 4.57): rope_theta,
    partial_rotary_factor and full_attention_interval at the top level, no layer_types."""
    hf, path = hf_model(make_hf_model, "qwen3_next_moe")
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None,
               full_attention_interval=4, torch_dtype=cfg.pop("dtype"))
    (path / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig.from_file(path)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.partial_rotary_factor == 0.25 and config.torch_dtype == "float32"
    assert hf_config_dict(config) == {**cfg, "architectures": ["Qwen3NextForCausalLM"]}
    ids = tokens(1, 12)
    with torch.no_grad():
        assert_close(load_hf_model(path)(ids), hf(ids).logits)


MULTIMODAL_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
                     "num_position_embeddings": 16, "patch_size": 4}


@pytest.mark.parametrize("family, text", [("qwen3_5", {**HYBRID, "intermediate_size": 96}),
                                          ("qwen3_5_moe", {**HYBRID, **EXPERTS})])
def test_multimodal_checkpoint_loads_its_text_model(family, text, make_hf_model, tokens, tmp_path, caplog):
    """A Qwen3.5 checkpoint as published (``*ForConditionalGeneration``): the text model under
    ``model.language_model.*`` is loaded and the vision tower left out with a one-line report;
    text-only input gives the logits transformers' multimodal model gives; export writes the
    text weights under their names and the config.json it read."""
    hf, path = make_hf_model(family, text_config=text, vision_config=MULTIMODAL_VISION)
    stored = load_file(path / "model.safetensors")
    visual = sorted(n for n in stored if n.startswith("model.visual."))
    assert visual
    with caplog.at_level(logging.WARNING, logger="llmflow.weights.hf"):
        ours = load_hf_model(path).eval()
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1 and f"left out {len(visual)} tensors of the vision tower (model.visual.*)" in lines[0]
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        assert_close(ours(ids), hf(input_ids=ids).logits)
    saved = save_hf_model(ours, tmp_path / "out")
    written = load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(n for n in stored if n not in visual)
    for name, tensor in written.items():
        assert torch.equal(tensor, stored[name]), name
    assert json.loads((saved / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def test_mtp_tensors_are_left_out(make_hf_model, caplog):
    _, path = hf_model(make_hf_model, "qwen3_5_text")
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.norm.weight"] = torch.zeros(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="llmflow.weights.hf"):
        load_hf_model(path)
    assert "left out 2 tensors of the multi-token prediction layers (mtp.*)" in caplog.text


def test_random_initialisation_matches_transformers_conventions():
    config = ModelConfig.from_hf({"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 2,
                                  "head_dim": 16, **LINEAR})
    from llmflow.models import CausalLM

    with torch.device("meta"):
        model = CausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    deltanet = model.model.layers["0"].linear_attn
    assert isinstance(deltanet, GatedDeltaNet)
    assert torch.equal(model.model.norm.weight, torch.zeros(32))
    assert torch.equal(deltanet.norm.weight, torch.ones(16)) and torch.equal(deltanet.dt_bias, torch.ones(4))
    assert ((deltanet.A_log.exp() >= 0.01 - 1e-6) & (deltanet.A_log.exp() <= 16 + 1e-4)).all()
    assert deltanet.conv1d.weight.std() > 0


FUSED_CASES = ["qwen3_5_moe_text", "qwen3_next_moe"]


def fused_copy(hf, directory):
    """``hf`` saved as transformers holds it in memory (``save_original_format=False``): every
    layer's experts fused into ``mlp.experts.gate_up_proj`` [E, 2 I, H] and
    ``mlp.experts.down_proj`` [E, H, I], the layout of the published Qwen3.5-MoE checkpoints."""
    hf.save_pretrained(directory, save_original_format=False)
    return directory


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_experts_load_bit_exact_streamed_and_export_per_expert(case, make_hf_model, tokens, tmp_path):
    """A checkpoint with fused experts (which transformers reads as it reads per-expert ones)
    loads into the same weights, bit for bit, whole, converted and by a rank's sharded load
    (each expert's slab read alone); the logits are transformers'; export writes one tensor
    per expert, the layout transformers' save_pretrained writes."""
    from test_sharded_loading import load_both
    from transformers import AutoModelForCausalLM

    from llmflow.weights.convert import ConvertConfig, convert
    from llmflow.weights.hf import index_hf_tensors

    hf, per_expert = hf_model(make_hf_model, case)
    fused = fused_copy(hf, tmp_path / "fused")
    stored = load_file(fused / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert stored["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 32)
    assert not [n for n in stored if ".experts.0." in n]
    want = load_hf_model(per_expert).state_dict()
    converted = convert(ConvertConfig(hf=fused, out=tmp_path / "ckpt", pad_vocab_to_multiple=1))
    for got in (load_hf_model(fused).state_dict(), load_model(converted)[0].state_dict()):
        assert list(got) == list(want)
        assert [n for n in want if not torch.equal(got[n], want[n])] == []
    _, sharded, report, _, _ = load_both(fused)
    assert [n for n, p in sharded.named_parameters() if not torch.equal(p, want[n])] == []
    experts = [t for n, t in index_hf_tensors(fused).items() if n.endswith("experts.gate_up_proj")]
    assert report.bytes_read == sum(t.nbytes for t in index_hf_tensors(fused).values())
    assert report.largest_read < experts[0].nbytes  # an expert's slab at a time, never the fused tensor
    ids = tokens(BATCH, SEQ)
    theirs = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(load_hf_model(fused).eval()(ids), hf(ids).logits)
        assert torch.equal(theirs(ids).logits, hf(ids).logits)
    saved = save_hf_model(load_hf_model(fused), tmp_path / "out")
    written, original = load_file(saved / "model.safetensors"), load_file(per_expert / "model.safetensors")
    assert sorted(written) == sorted(original)
    assert [n for n in original if not torch.equal(written[n], original[n])] == []


def test_fused_experts_are_checked_before_reading(make_hf_model, tmp_path):
    """A fused tensor of the wrong shape, experts stored both ways, and a NaN in one expert's
    slab: each refused naming the tensor (the slab by its expert and rows)."""
    from llmflow.weights import CheckpointError

    hf, _ = hf_model(make_hf_model, "qwen3_5_moe_text")
    fused = fused_copy(hf, tmp_path / "fused")
    file = fused / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    bad = dict(tensors, **{name: tensors[name][:, :48].contiguous()})
    save_file(bad, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{name}' has shape (4, 48, 64), config.json implies "
                                                        "(4, 64, 64) (experts fused along dim 0)")):
        load_hf_model(fused)
    both = dict(tensors, **{"model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(32, 64)})
    save_file(both, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape("the experts of 'model.layers.1.mlp.experts.up_proj' are "
                                                        f"stored both fused ('{name}') and one tensor per expert")):
        load_hf_model(fused)
    tensors[name][1, 40, 3] = float("nan")  # expert 1, an up_proj row
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{file}: tensor '{name}[1, 32:64]' holds non-finite")):
        load_hf_model(fused)


def test_multimodal_fused_experts_load_as_transformers_reads_them(make_hf_model, tokens, tmp_path):
    """Qwen3.5-MoE as published: ``model.language_model.*`` with fused experts beside the vision
    tower; the text model's logits are transformers'."""
    hf, _ = make_hf_model("qwen3_5_moe", text_config={**HYBRID, **EXPERTS}, vision_config=MULTIMODAL_VISION)
    fused = fused_copy(hf, tmp_path / "fused")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in load_file(fused / "model.safetensors")
    ids = tokens(BATCH, SEQ)
    with torch.no_grad():
        assert_close(load_hf_model(fused).eval()(ids), hf(input_ids=ids).logits)


def test_multimodal_checkpoint_goes_through_every_stage(sample_assets, make_hf_model, tmp_path, capsys):
    """A Qwen3.5 checkpoint as published (``Qwen3_5ForConditionalGeneration``, a tiny vision
    tower; its decoder's keys only in ``text_config``) over the sample's tokenizer: its
    vocabulary checked at tokenizing, converted, trained two steps, exported (transformers'
    multimodal class computes the trained text model's logits), generated from with several
    prompts and evaluated on MMLU, each stage in this process."""
    from transformers import Qwen3_5ForConditionalGeneration

    from llmflow.cli import main
    from llmflow.data.tokenize_instruction import InstructionTokenizeConfig, tokenize_instruction
    from llmflow.data.tokenizer import tokenizer_info
    from llmflow.evaluate.benchmarks import MMLU
    from llmflow.evaluate.engine import EvalConfig, evaluate
    from llmflow.evaluate.settings import context_length
    from llmflow.infer.generator import load_generator
    from llmflow.train.config import TrainConfig
    from llmflow.train.loop import train
    from llmflow.train.routing import aux_loss_coefficient
    from llmflow.weights.convert import ConvertConfig, convert
    from llmflow.weights.export import ExportConfig, export
    from llmflow.weights.tokenizer_files import copy_tokenizer_files

    sample = sample_assets()
    vocab = json.loads((sample / "model" / "config.json").read_text())["vocab_size"]
    _, model = make_hf_model("qwen3_5", text_config={**HYBRID, "vocab_size": vocab}, vision_config=MULTIMODAL_VISION)
    copy_tokenizer_files(sample / "model", model)
    hf_config = json.loads((model / "config.json").read_text())
    assert "vocab_size" not in hf_config and hf_config["text_config"]["vocab_size"] == vocab
    assert tokenizer_info(model).config_vocab_size == vocab
    assert context_length(hf_config) == 128
    moe = {"model_type": "qwen3_5_moe", "text_config": {"output_router_logits": True, "router_aux_loss_coef": 0.01}}
    assert aux_loss_coefficient(None, moe) == 0.01

    data = tokenize_instruction(InstructionTokenizeConfig(input=[sample / "instruct" / "alpaca.jsonl"], tokenizer=model,
                                                          out=tmp_path / "sft", format="alpaca", seq_length=64, pack=True))
    ckpt = convert(ConvertConfig(hf=model, out=tmp_path / "ckpt"))
    run = TrainConfig.model_validate({"model": str(ckpt), "out": str(tmp_path / "run"), "steps": 2,
                                      "data": {"kind": "sft", "paths": [str(data)]}, "micro_batch_size": 2,
                                      "global_batch_size": 2, "optim": {"lr": 1e-2}, "log_interval": 1})
    train(run)
    assert re.search(r"^step 2/2 \| loss [0-9.]+", capsys.readouterr().out, re.MULTILINE)
    exported = export(ExportConfig(ckpt=run.out, out=tmp_path / "hf"))
    assert json.loads((exported / "config.json").read_text())["text_config"]["vocab_size"] == vocab
    trained, _ = load_model(run.out)
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(exported, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = trained.eval()(ids)[..., :vocab]
        assert_close(theirs.eval()(input_ids=ids).logits, want, atol=1e-4)
        assert (want - load_hf_model(model).eval()(ids)).abs().max() > 1e-3  # training changed it

    gen = load_generator(exported)
    assert gen.vocab_size == vocab
    prompts = ["What is the capital of France?", "Name a river", "hi"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    main(["generate", "--model", str(exported), "--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "6"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    alone = [gen.run([p], GenerateConfig(max_new_tokens=6))[0].text for p in prompts]
    assert [line["completion"] for line in lines] == alone

    out = evaluate(MMLU, EvalConfig(model=exported, data=sample / "mmlu" / "hf", out=tmp_path / "mmlu", shots=1,
                                    limit=3, device="cpu"))
    results = json.loads((out / "results.json").read_text())
    assert results["questions"] == 3 * len(results["subjects"]) > 0
    assert results["settings"]["max_length"] == 128


def test_generate_command_and_chat_keep_the_linear_layers_states(make_hf_model, tmp_path, capsys):
    """``llmflow generate --prompts`` (several prompts, one left-padded batch), the inference
    stage (batches of two) and the chat loop (a second turn over the first's history) on
    Qwen3.5: each reply is the greedy continuation transformers gives its prompt alone."""
    from llmflow.cli import main
    from llmflow.data.templates import load_template
    from llmflow.infer.batch import InferConfig, run_inference
    from llmflow.infer.command import chat_loop
    from llmflow.infer.generator import load_generator

    hf, path = make_hf_model("qwen3_5_text", **{**HYBRID, "vocab_size": VOCAB})
    add_tokenizer(path)
    eos = 5
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    gen = load_generator(path)
    config = GenerateConfig(max_new_tokens=8)
    prompts = ["the cat sat on", "dogs", "green hills near blue lakes and fish"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    main(["generate", "--model", str(path), "--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "8"])
    completions = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    alone = [gen.run([p], config)[0] for p in prompts]
    assert completions == [r.text for r in alone]
    assert [r.tokens for r in alone] == [hf_greedy(hf, [gen.tokenizer.encode(p).ids], 8, eos)[0] for p in prompts]
    # The inference stage: the same prompts in batches of two (the longest first), on CPU in fp32.
    out = run_inference(InferConfig(model=path, prompts=tmp_path / "prompts.jsonl", out=tmp_path / "infer",
                                    batch_size=2, max_new_tokens=8, device="cpu", dtype="fp32"))
    records = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [r["output"] for r in records] == [r.text for r in alone]

    template = load_template(path, "chatml")
    history = chat_loop(gen, template, config, io.StringIO("hello\nthe cat\n/exit\n"), io.StringIO())
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    ids = gen.tokenizer.encode(template.render(history[:3], add_generation_prompt=True), add_special_tokens=False).ids
    second = gen.run([ids], config)[0]
    assert history[3]["content"] == second.text
    assert second.tokens == hf_greedy(hf, [ids], 8, eos)[0]


def test_a_multimodal_configs_null_text_keys_are_read_from_its_top_level():
    """transformers writes a sub-config's unset dtype (and may write token ids) as null: the
    top level's values are the model's, and an export writes them back where they were."""
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
            "num_attention_heads": 2, "head_dim": 16, **LINEAR, "dtype": None, "eos_token_id": None}
    hf = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "dtype": "bfloat16",
          "eos_token_id": 7, "tie_word_embeddings": False, "text_config": text}
    config = ModelConfig.from_hf(hf)
    assert (config.torch_dtype, config.eos_token_id) == ("bfloat16", 7)
    written = hf_config_dict(config)
    assert (written["eos_token_id"], written["dtype"]) == (7, "bfloat16")
    assert written["text_config"]["eos_token_id"] is None and written["text_config"]["dtype"] is None
