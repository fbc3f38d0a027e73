"""Chat-model evaluation against lm-evaluation-harness 0.4.13: ``apply_chat_template``,
``fewshot_as_multiturn``, ``system_instruction``, the template's own variables
(``enable_thinking``) and ``think_end_token``. The rendered prompts equal the harness's
``fewshot_context`` (with its hf backend's ``apply_chat_template``) for GSM8K, BBH, MMLU and
BoolQ under every combination; end to end, ``llmflow eval`` and the real harness on the same
model and data give the same contexts, generations (less their reasoning), extracted answers,
log-likelihoods and scores. Bad settings and a template that cannot render a system message
are refused before the model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness_runs import harness_results, harness_samples, harness_task, ours, parrot_model, run_harness
from test_generative_tasks import BBH_PAIR, assert_same_metrics, assert_same_samples, bbh_harness_tasks
from test_generative_tasks import harness_samples as filter_samples

from llmflow.data.templates import TemplateError
from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.chat_context import ChatSettings, PromptRenderer, maybe_delimit
from llmflow.evaluate.choice_engine import ChoiceEvalConfig
from llmflow.evaluate.choice_engine import build_runs as choice_runs
from llmflow.evaluate.choice_tasks import BOOLQ
from llmflow.evaluate.engine import EvalConfig, evaluate, prompts_for, select_questions
from llmflow.evaluate.generative_engine import GenerativeEvalConfig, build_runs, evaluate_generative
from llmflow.evaluate.generative_tasks import BBH, GSM8K
from llmflow.evaluate.mmlu_data import load_mmlu
from llmflow.evaluate.task_selection import select_tasks

SYSTEM = "You are a careful solver."
# Qwen3's way with thinking: enable_thinking=false opens and closes an empty think block.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
SETTINGS = [
    {"apply_chat_template": True},
    {"apply_chat_template": True, "fewshot_as_multiturn": False, "system_instruction": SYSTEM},
    {"apply_chat_template": True, "system_instruction": SYSTEM},
    {"system_instruction": SYSTEM},
]


def thinking_model(model: Path, out: Path) -> Path:
    """``model`` with Qwen3's thinking switch in its chat template."""
    shutil.copytree(model, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    return out


def harness_chat_template(model: Path, **variables):
    """The harness's hf backend's ``apply_chat_template`` over the model's transformers tokenizer."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)

    def render(messages, add_generation_prompt=True):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt, **variables)

    return render


def harness_kwargs(settings: dict, model: Path, **variables) -> dict:
    """``fewshot_context``'s chat arguments as the harness's evaluator passes them."""
    chat = settings.get("apply_chat_template", False)
    return {"system_instruction": settings.get("system_instruction"), "apply_chat_template": chat,
            "fewshot_as_multiturn": settings.get("fewshot_as_multiturn", chat),
            "chat_template": harness_chat_template(model, **variables) if chat else None}


def test_maybe_delimit_is_the_harness():
    from lm_eval.api.utils import maybe_delimit as theirs

    for prefix, suffix in [(None, "x"), ("", "x"), ("a", None), ("a", ""), ("a", "b"), ("a ", "b"), ("a", "\nb"),
                           ("a\n", "b"), (None, None)]:
        assert maybe_delimit(prefix, suffix, "\n\n") == theirs(prefix, suffix, "\n\n"), (prefix, suffix)


@pytest.fixture(scope="module")
def harness_tasks(sample_assets, tmp_path_factory):
    """The harness's gsm8k_cot, two bbh_cot_fewshot tasks, MMLU geography and BoolQ on the sample's data."""
    import datasets
    from lm_eval.tasks import TaskManager

    sample, root = sample_assets(), tmp_path_factory.mktemp("chat-tasks")
    harness_task(root, "h_gsm8k_cot", "gsm8k/gsm8k-cot.yaml", {"test": next((sample / "gsm8k").rglob("*.parquet"))})
    bbh_harness_tasks(root, sample / "bbh", "h_")
    geography = sample / "mmlu" / "hf" / "geography"
    harness_task(root, "h_mmlu_geography", "mmlu/default/mmlu_high_school_geography.yaml",
                 {split: geography / f"{split}-00000-of-00001.parquet" for split in ("dev", "test")})
    with open(root / "h_mmlu_geography.yaml", "a") as f:
        f.write('description: "The following are multiple choice questions (with answers) about geography.\\n\\n"\n')
    harness_task(root, "h_boolq", "super_glue/boolq/default.yaml",
                 {split: next((sample / "boolq").rglob(f"{split}-*.parquet")) for split in ("train", "validation")})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets-cache")
        names = ["h_gsm8k_cot", *(f"h_{n}" for n in BBH_PAIR), "h_mmlu_geography", "h_boolq"]
        return TaskManager(include_path=str(root), include_defaults=False).load(names)["tasks"]


@pytest.mark.parametrize("settings", SETTINGS, ids=["multiturn", "single-turn+system", "multiturn+system", "plain+system"])
def test_prompts_are_the_harness_fewshot_context(settings, harness_tasks, sample_assets, tmp_path):
    sample = sample_assets()
    model = sample / "model"
    renderer = PromptRenderer(ChatSettings(**settings), model)
    kwargs = harness_kwargs(settings, model)
    for group, names, root, shots in ((GSM8K, ["gsm8k_cot"], sample / "gsm8k", 8), (BBH, BBH_PAIR, sample / "bbh", 3)):
        for run in build_runs(group, select_tasks(group.title, group.tasks, names), root, shots, 3, renderer):
            theirs = harness_tasks[f"h_{run.task.name}"]
            docs = list(theirs.eval_docs)[:3]
            assert [theirs.fewshot_context(d, shots, **kwargs) for d in docs] == run.contexts, run.task.name
    data = load_mmlu(sample / "mmlu" / "hf", ["geography"])
    mine = prompts_for(MMLU, select_questions(MMLU, data, 3), data, 5, renderer)
    theirs = harness_tasks["h_mmlu_geography"]
    theirs.set_fewshot_seed(1234)
    assert [theirs.fewshot_context(d, 5, **kwargs) for d in list(theirs.eval_docs)[:3]] == mine
    config = ChoiceEvalConfig(model=model, data=sample / "boolq", out=tmp_path / "x", shots=2, limit=3, **settings)
    (run,) = choice_runs(BOOLQ, list(BOOLQ.tasks), sample / "boolq", config, renderer)
    theirs = harness_tasks["h_boolq"]
    theirs.set_fewshot_seed(1234)
    assert [theirs.fewshot_context(d, 2, **kwargs) for d in list(theirs.eval_docs)[:3]] == run.contexts
    if settings.get("apply_chat_template"):
        assert run.contexts[0].endswith("<|im_start|>assistant\n")


def test_template_variables_reach_the_template(harness_tasks, sample_assets, tmp_path):
    model = thinking_model(sample_assets() / "model", tmp_path / "thinking")
    for enable in (False, True):
        settings = ChatSettings(apply_chat_template=True, enable_thinking=enable, think_end_token="</think>")
        (run,) = build_runs(GSM8K, list(GSM8K.tasks), sample_assets() / "gsm8k", 2, 2, PromptRenderer(settings, model))
        theirs = harness_tasks["h_gsm8k_cot"]
        kwargs = harness_kwargs({"apply_chat_template": True}, model, enable_thinking=enable)
        assert [theirs.fewshot_context(d, 2, **kwargs) for d in list(theirs.eval_docs)[:2]] == run.contexts
        assert run.contexts[0].endswith("<think>\n\n</think>\n\n") is not enable


def test_bad_chat_settings_are_refused_before_the_model_loads(sample_assets, tmp_path):
    with pytest.raises(ValueError, match="fewshot_as_multiturn=true needs apply_chat_template=true"):
        ChatSettings(fewshot_as_multiturn=True)
    with pytest.raises(ValueError, match="enable_thinking=true needs think_end_token"):
        ChatSettings(apply_chat_template=True, enable_thinking=True)
    with pytest.raises(ValueError, match="chat template variables; set apply_chat_template=true"):
        ChatSettings(enable_thinking=False)
    sample = sample_assets()
    # A tokenizer without weights: anything that got as far as loading the model would fail otherwise.
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (sample / "model" / name).is_file():
            shutil.copyfile(sample / "model" / name, tokenizer / name)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                 "{% endif %}{{ m['content'] }}{% endfor %}")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": no_system}))
    common = {"model": tokenizer, "out": tmp_path / "out", "apply_chat_template": True}
    with pytest.raises(TemplateError, match=rf"gsm8k_cot: the chat template of {tokenizer / 'tokenizer_config.json'} "
                                            r"cannot render this prompt with a system message \(from system_instruction\)"
                                            r": .*System role not supported"):
        evaluate_generative(GSM8K, GenerativeEvalConfig(**common, data=sample / "gsm8k", system_instruction=SYSTEM))
    with pytest.raises(TemplateError, match=r"subject \w+: .* with a system message \(from the task's "
                                            r"description\)"):
        evaluate(MMLU, EvalConfig(**common, data=sample / "mmlu" / "hf"))
    with pytest.raises(ValueError, match=r"enable_thinking=true: MMLU is scored by the log-likelihood"):
        evaluate(MMLU, EvalConfig(**common, data=sample / "mmlu" / "hf", enable_thinking=True, think_end_token="</think>"))
    assert not (tmp_path / "out").exists()


# --- end to end, against the real harness ------------------------------------------------------


@pytest.mark.slow
def test_gsm8k_multiturn_with_a_system_instruction_agrees_with_lm_eval(sample_assets, tmp_path):
    model, data = sample_assets() / "model", sample_assets() / "gsm8k"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    harness_task(tasks, "llmflow_gsm8k_cot", "gsm8k/gsm8k-cot.yaml", {"test": next(data.rglob("test-*.parquet"))})
    run_harness(model, "llmflow_gsm8k_cot", tasks, tmp_path / "harness", limit=4, max_gen_toks=24,
                chat={"apply_chat_template": True, "system_instruction": SYSTEM})
    results, predictions = ours(tmp_path, "gsm8k", model, data, "--limit", "4", "--max-new-tokens", "24",
                                "--apply-chat-template", "--system-instruction", SYSTEM)
    theirs = filter_samples(tmp_path / "harness", "llmflow_gsm8k_cot")
    contexts = [s["arguments"]["gen_args_0"]["arg_0"] for s in theirs["strict-match"]]
    assert all(c.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nQ: ") for c in contexts)
    assert_same_samples(theirs, predictions, contexts)
    assert_same_metrics(harness_results(tmp_path / "harness")["llmflow_gsm8k_cot"], results["tasks"]["gsm8k_cot"],
                        list(theirs))
    assert results["tasks"]["gsm8k_cot"]["first_prompt"] == contexts[0]
    assert results["settings"]["fewshot_as_multiturn"] is True


@pytest.mark.slow
def test_bbh_thinking_single_turn_agrees_with_lm_eval(sample_assets, tmp_path):
    """A model that reasons, ends its reasoning with the think_end_token ("END"), then answers:
    the harness and llmflow both score the text after it."""
    base = thinking_model(sample_assets() / "model", tmp_path / "thinking")
    model = parrot_model(base, tmp_path / "parrot", " Maybe? END So the answer is 7.")
    data = sample_assets() / "bbh"
    tasks = bbh_harness_tasks(tmp_path / "tasks", data)
    think = "END"
    run_harness(model, ",".join(f"llmflow_{n}" for n in BBH_PAIR), tasks, tmp_path / "harness", limit=3,
                max_gen_toks=24, chat={"apply_chat_template": True, "fewshot_as_multiturn": False},
                model_extra={"enable_thinking": True, "think_end_token": think})
    results, predictions = ours(tmp_path, "bbh", model, data, "--limit", "3", "--max-new-tokens", "24",
                                "--tasks", json.dumps(BBH_PAIR), "--apply-chat-template", "--fewshot-as-multiturn",
                                "false", "--enable-thinking", "true", "--think-end-token", think)
    for name in BBH_PAIR:
        theirs = filter_samples(tmp_path / "harness", f"llmflow_{name}")
        mine = [p for p in predictions if p["task"] == name]
        contexts = [s["arguments"]["gen_args_0"]["arg_0"] for s in theirs["get-answer"]]
        assert_same_samples(theirs, mine, contexts)
        assert {p["generated"] for p in mine} == {"So the answer is 7."}
        assert {p["extracted"]["get-answer"] for p in mine} == {"7"}
        assert_same_metrics(harness_results(tmp_path / "harness")[f"llmflow_{name}"], results["tasks"][name],
                            ["get-answer"])
    assert (results["settings"]["enable_thinking"], results["settings"]["think_end_token"]) == (True, think)


@pytest.mark.slow
def test_mmlu_with_the_chat_template_agrees_with_lm_eval(sample_assets, tmp_path):
    """Log-likelihoods of the bare letters after the assistant's turn header (the header's
    newline moves into them), 2-shot as user/assistant turns, within 1e-5."""
    sample = sample_assets()
    model = sample / "model"
    subject = sample / "mmlu" / "hf" / "geography"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    harness_task(tasks, "llmflow_mmlu_geography", "mmlu/default/mmlu_high_school_geography.yaml",
                 {split: subject / f"{split}-00000-of-00001.parquet" for split in ("dev", "test")})
    with open(tasks / "llmflow_mmlu_geography.yaml", "a") as f:
        f.write('description: "The following are multiple choice questions (with answers) about geography.\\n\\n"\n')
    run_harness(model, "llmflow_mmlu_geography", tasks, tmp_path / "harness", shots=2, limit=6,
                chat={"apply_chat_template": True})
    results, predictions = ours(tmp_path, "mmlu", model, sample / "mmlu" / "hf", "--shots", "2", "--limit", "6",
                                "--subjects", "geography", "--apply-chat-template")
    theirs = harness_samples(tmp_path / "harness", "llmflow_mmlu_geography")
    assert len(theirs) == len(predictions) == 6
    largest = 0.0
    for row, prediction in zip(theirs, predictions, strict=True):
        assert row["arguments"]["gen_args_0"]["arg_1"] == "A"
        scores = [float(response[0]) for response in row["filtered_resps"]]
        assert prediction["scores"] == pytest.approx(scores, rel=0, abs=1e-5), row["doc_id"]
        largest = max(largest, *(abs(a - b) for a, b in zip(prediction["scores"], scores)))
    print(f"MMLU under the chat template: largest log-likelihood difference {largest:.1e}")
    expected = harness_results(tmp_path / "harness")["llmflow_mmlu_geography"]
    assert results["accuracy"] == pytest.approx(expected["acc,none"], abs=1e-12)
    assert results["first_prompt"] == theirs[0]["arguments"]["gen_args_0"]["arg_0"]


@pytest.mark.slow
def test_the_evaluate_flow_runs_the_reasoning_benchmarks_under_chat_settings(prefect_env, monkeypatch, tmp_path):
    """MATH-500, MMLU-Pro, GPQA Diamond and IFEval on the sample data through the evaluate flow,
    the chat template and a system instruction applied: each a stage with its MLflow run, the
    chat settings among its params and its first prompt, exactly as results.json has it, among
    its artifacts; thinking with a log-likelihood benchmark is refused before any stage."""
    from mlflow import MlflowClient
    from prefect_helpers import mlflow_runs, task_states

    from llmflow.flows.evaluate import EvaluateParams, evaluate

    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")
    benchmarks = ["minerva-math500", "mmlu-pro", "gpqa-diamond", "ifeval"]
    chat = {"apply_chat_template": True, "system_instruction": SYSTEM}
    params = EvaluateParams.model_validate({
        "workspace": str(tmp_path / "ws"), "benchmarks": benchmarks, "evaluation": {"limit": 2, "max_new_tokens": 8, **chat},
        "benchmark_data": {"minerva_math500": "sample", "mmlu_pro": "sample", "gpqa_diamond": "sample", "ifeval": "sample"},
    })
    state = evaluate(**dict(params), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    states = task_states(state.state_details.flow_run_id)
    assert all(states[f"eval-{b}"] == ["Completed"] for b in benchmarks) and all(0 <= result[b] <= 1 for b in benchmarks)
    for benchmark in benchmarks:
        (run,) = mlflow_runs(prefect_env, f"eval-{benchmark}")
        assert (run.data.params["apply_chat_template"], run.data.params["system_instruction"]) == ("True", SYSTEM)
        out = next(p for p in (tmp_path / "ws" / "eval").iterdir() if p.name.startswith("sample-") and
                   json.loads((p / "results.json").read_text())["benchmark"] == benchmark)
        tasks = json.loads((out / "results.json").read_text())["tasks"]
        client = MlflowClient(prefect_env["mlflow_uri"])
        for name, scores in tasks.items():
            prompt = client.download_artifacts(run.info.run_id, f"prompts/{name}.txt", str(tmp_path / benchmark))
            assert Path(prompt).read_text() == scores["first_prompt"]
            assert scores["first_prompt"].startswith(f"<|im_start|>system\n{SYSTEM}")
    with pytest.raises(ValueError, match=r"evaluation.enable_thinking=true: mmlu score the log-likelihood"):
        EvaluateParams.model_validate({"benchmarks": ["mmlu", "ifeval"], "evaluation": {
            "apply_chat_template": True, "enable_thinking": True, "think_end_token": "</think>"}})


def test_think_end_token_cuts_the_text_or_the_tokens_as_the_harness_does(sample_assets):
    """A text think_end_token: what follows its last occurrence in the decoded text, stripped
    on the left (postprocess_generated_text); digits: the tokens after the last occurrence of
    that id, decoded and stripped (generate_until's integer branch); none found: the whole
    text, stripped only for a token id."""
    from lm_eval.models.utils import postprocess_generated_text

    from llmflow.data.tokenizer import hf_tokenizer
    from llmflow.evaluate.generative_engine import answer_text

    hf = hf_tokenizer(sample_assets() / "model")
    text = " first thought END second END  So the answer is 7."
    tokens = hf.encode(text, add_special_tokens=False)
    assert answer_text(hf, tokens, "END") == postprocess_generated_text(text, [], "END") == "So the answer is 7."
    assert answer_text(hf, tokens, None) == text
    end = tokens[3]
    last = max(i for i, t in enumerate(tokens) if t == end)
    assert answer_text(hf, tokens, str(end)) == hf.decode(tokens[last + 1 :], skip_special_tokens=True).lstrip()
    missing = next(i for i in range(hf.vocab_size) if i not in tokens)
    assert answer_text(hf, tokens, str(missing)) == text.lstrip()
