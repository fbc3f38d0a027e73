"""What the flows share: where each stage's output goes in the workspace, how a source
becomes a local path, and how a stage task is called so that retries skip finished work."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import Task
from prefect.runtime import deployment, flow_run
from pydantic import BaseModel

from llmflow import tracking
from llmflow.artifacts import atomic_file, read_manifest
from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig
from llmflow.download import DownloadConfig, parse_source
from llmflow.evaluate.chat_context import ChatSettings
from llmflow.evaluate.engine import EvalConfig
from llmflow.evaluate.task_groups import TASK_GROUPS, config_type
from llmflow.flows.params import MEGATRON, SAMPLE, BenchmarkSources, EvalParams
from llmflow.sample.assets import SampleConfig
from llmflow.sample.choice_tasks import AGIEVAL_TASKS as SAMPLE_AGIEVAL_TASKS
from llmflow.sample.generative_tasks import BBH_SUBTASKS as SAMPLE_BBH_SUBTASKS
from llmflow.sample.reasoning_choice_tasks import MMLU_PRO_CATEGORIES as SAMPLE_MMLU_PRO_CATEGORIES
from llmflow.tasks.common import StageArtifact
from llmflow.tasks.convert import convert_task
from llmflow.tasks.download import download_task
from llmflow.tasks.evaluate import EVAL_TASKS
from llmflow.tasks.sample import sample_task
from llmflow.tasks.tokenize import tokenize_pretrain_task
from llmflow.tasks.train import STAGE as TRAIN_STAGE
from llmflow.weights import latest_step_dir
from llmflow.weights.convert import ConvertConfig
from llmflow.workspace import flow_workspace

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".txt", ".arrow")


def slug(source: str) -> str:
    """A directory name for a source: ``hf://Qwen/Qwen2.5-0.5B`` -> ``Qwen--Qwen2.5-0.5B``; a
    local path gets a tag of its full path (two ``model`` directories never collide)."""
    if source == SAMPLE:
        return SAMPLE
    if "://" in source:
        name = source.split("://", 1)[1]
    else:
        path = Path(source).expanduser().resolve()
        name = f"{path.name}-{settings_tag(str(path))}"
    return re.sub(r"[^\w.-]+", "--", name).strip("-.") or "source"


def settings_tag(*settings: Any) -> str:
    """Eight hex digits naming a combination of settings, so outputs made with different
    settings never share (and overwrite) a directory."""
    payload = json.dumps([s.model_dump(mode="json") if isinstance(s, BaseModel) else s for s in settings],
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:8]


def run_version(version: str | None, scheduled: datetime | None) -> str:
    """The version a run's finetune carries: the given one, else the flow run's scheduled
    date (a retry keeps its date; tomorrow's nightly run gets a new one)."""
    if version:
        return version
    return (scheduled or datetime.now(timezone.utc)).strftime("%Y-%m-%d")


def write_prompts(workspace: Path, prompts: list[str]) -> Path:
    """The prompts as a jsonl file named by its content (so an unchanged list keeps the
    inference stage's cache key)."""
    path = workspace / "prompts" / f"{settings_tag(prompts)}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, "w") as f:
            f.writelines(json.dumps({"prompt": prompt}, ensure_ascii=False) + "\n" for prompt in prompts)
    return path


def intact(artifact: StageArtifact) -> bool:
    """Whether a stage's output is still there as its artifact describes it."""
    path = Path(artifact.path)
    if artifact.stage == TRAIN_STAGE:
        latest = latest_step_dir(path)
        return latest is not None and latest.name == artifact.manifest.get("step_dir")
    return read_manifest(path) is not None


def run(task: Task, *args: Any, refresh: Collection[str] = (), **kwargs: Any) -> Any:
    """Call a stage task in the flow (never ``submit``: a cancelled run must unwind through
    the task so its workers are killed). A cached result whose output has since been
    deleted runs the stage again; naming the task in ``refresh`` (the stage names the UI
    shows) forces it."""
    forced = task.name in refresh
    result = task.with_options(refresh_cache=True if forced else None)(*args, **kwargs)
    if isinstance(result, StageArtifact) and not forced and not intact(result):
        result = task.with_options(refresh_cache=True)(*args, **kwargs)
    return result


SAMPLE_TASKS = {"agieval": [f"agieval_{t.replace('-', '_')}" for t in SAMPLE_AGIEVAL_TASKS],
                "bbh": [f"bbh_cot_fewshot_{t}" for t in SAMPLE_BBH_SUBTASKS],
                "mmlu-pro": [f"mmlu_pro_{c.replace(' ', '_')}" for c in SAMPLE_MMLU_PRO_CATEGORIES]}
"""The tasks the sample assets hold of the groups it does not hold whole."""


def run_eval(workspace: Path, evaluation: EvalParams, model: str | Path, data: str, name: str,
             refresh: Collection[str] = (), benchmark: str = "mmlu", tasks: list[str] | None = None) -> StageArtifact:
    """The ``benchmark`` evaluation stage on ``model`` into ``eval/{name}-{settings}``; hub data
    is cached under the workspace's ``downloads/``. The benchmarks other than the four-choice
    ones (``tasks``: which of their tasks) take the shared limit, batch size and chat settings
    and run at lm-evaluation-harness's default shots."""
    common = {"model": model, "data": data, "cache_dir": workspace / "downloads",
              "out": workspace / "eval" / f"{name}-{settings_tag(benchmark, evaluation, *([tasks] if tasks else []))}"}
    if benchmark in TASK_GROUPS:
        config_class = config_type(TASK_GROUPS[benchmark])
        shared = {"limit", "batch_size", "max_new_tokens", *ChatSettings.model_fields}
        settings = evaluation.model_dump(include=shared & set(config_class.model_fields))
        config = config_class(**common, **settings, tasks=tasks)
        return run(EVAL_TASKS[benchmark], config, refresh=refresh)
    config = EvalConfig(**common, **evaluation.model_dump(exclude={"data", "max_new_tokens"}))
    return run(EVAL_TASKS[benchmark], config, refresh=refresh)


def run_benchmarks(context: FlowRun, evaluation: EvalParams, data: BenchmarkSources, benchmarks: list[str],
                   model: str | Path, name: str) -> dict[str, StageArtifact]:
    """Each of ``benchmarks``' evaluation stages on ``model``, its data from ``evaluation.data``
    (MMLU) or ``data``; "sample" sources are the sample stage's copies (with the sample's
    AGIEval and BBH tasks unless others are named)."""
    chosen = {"agieval": data.agieval_tasks, "bbh": data.bbh_tasks, "mmlu-pro": data.mmlu_pro_tasks}
    fields = data.model_dump(exclude={f"{group.replace('-', '_')}_tasks" for group in chosen})
    # A source's field is its benchmark's name with underscores (mmlu_pro: mmlu-pro).
    sources = {"mmlu": evaluation.data, **{name.replace("_", "-"): source for name, source in fields.items()}}
    tasks = {group: names or (SAMPLE_TASKS[group] if sources[group] == SAMPLE else None)
             for group, names in chosen.items()}
    return {benchmark: run_eval(context.workspace, evaluation, model,
                                context.sources.benchmark_data(benchmark, sources[benchmark]), name,
                                context.refresh, benchmark, tasks.get(benchmark))
            for benchmark in benchmarks}


def megatron_checkpoint(source: str) -> Path | None:
    """The Megatron checkpoint a ``megatron:///path`` model source names; None for other sources."""
    return Path(source.removeprefix(MEGATRON)) if source.startswith(MEGATRON) else None


def run_convert(context: FlowRun, model_dir: Path, name: str, init: str = "weights", seed: int = 0,
                megatron: Path | None = None) -> StageArtifact:
    """The convert stage of ``model_dir`` (or of the Megatron checkpoint ``megatron`` of that
    model) into ``checkpoints/{name}`` (``-random{seed}`` when initialised from the config):
    every flow, at every tensor-parallel degree, names a model's checkpoint alike, so they share it."""
    suffix = "" if init == "weights" else f"-random{seed}"
    config = ConvertConfig(hf=model_dir, megatron=megatron, out=context.workspace / "checkpoints" / f"{name}{suffix}",
                           init=init, seed=seed)
    return run(convert_task, config, refresh=context.refresh)


def run_tokenize_pretrain(context: FlowRun, texts: list[Path], tokenizer: Path, model: str, data: str,
                          data_files: list[str], text_key: str = "text") -> StageArtifact:
    """The pretraining-text tokenize stage into ``data/{model}/{data}-{settings}``: every flow
    names a tokenization alike, so they share it."""
    out = context.workspace / "data" / slug(model) / f"{slug(data)}-{settings_tag(data_files, text_key)}"
    config = PretrainTokenizeConfig(input=texts, tokenizer=tokenizer, text_key=text_key, append_eod=True, out=out)
    return run(tokenize_pretrain_task, config, refresh=context.refresh)


@dataclass
class FlowRun:
    """What a flow's stages share: the workspace, the run's version, the stages to refresh,
    the sources and the flow's MLflow run."""

    workspace: Path
    version: str
    refresh: set[str]
    sources: Sources
    mlflow_run: str


@contextlib.contextmanager
def open_flow_run(flow: str, params: BaseModel) -> Iterator[FlowRun]:
    """Set up a flow run from its parameters (``workspace``, ``refresh`` and, when present,
    ``version``): MLflow pointed at the workspace and the flow's experiment, the parent
    MLflow run opened (found again on a retry), the sources ready."""
    workspace = flow_workspace(params.workspace)
    tracking.configure(workspace, tracking.experiment_name(flow))
    version = run_version(getattr(params, "version", None), flow_run.scheduled_start_time)
    logged = params.model_dump(mode="json") | {"workspace": str(workspace), "version": version}
    refresh = set(params.refresh)
    with tracking.flow_run(flow, flow_run.id, logged, deployment.name) as parent:
        yield FlowRun(workspace, version, refresh, Sources(workspace, refresh), parent)


class Sources:
    """Turns flow sources into local paths inside one workspace: "sample" runs the sample
    stage (once), hub sources run the download stage, local paths are used in place."""

    def __init__(self, workspace: Path, refresh: set[str]):
        self.workspace = workspace
        self.refresh = refresh
        self._sample: Path | None = None

    def sample(self) -> Path:
        """The sample assets' directory."""
        if self._sample is None:
            config = SampleConfig(out=self.workspace / "sample")
            self._sample = Path(run(sample_task, config, refresh=self.refresh).path)
        return self._sample

    def fetch(self, source: str, repo_type: str = "model", revision: str | None = None,
              include: list[str] | None = None) -> Path:
        """A hub repository downloaded (or verified) under ``downloads/``; a local path as is."""
        if "://" not in source:
            path = Path(source).expanduser().resolve()
            if not path.exists():
                raise FileNotFoundError(f"source {source!r}: no such file or directory")
            return path
        parse_source(source)
        config = DownloadConfig(source=source, out=self.workspace / "downloads" / slug(source), revision=revision,
                                include=include or [], repo_type=repo_type)
        return Path(run(download_task, config, refresh=self.refresh).path)

    def model(self, source: str, revision: str | None = None) -> Path:
        """A Hugging Face model directory."""
        return self.sample() / "model" if source == SAMPLE else self.fetch(source, "model", revision)

    def instruction_data(self, source: str, files: list[str]) -> list[Path]:
        """The instruction data files: the sample's Alpaca parquet, or the data files of a
        dataset directory (matching ``files`` globs when given), or one local file."""
        if source == SAMPLE:
            return [self.sample() / "instruct" / "alpaca.parquet"]
        return data_files(self.fetch(source, "dataset"), files, source)

    def preference_data(self, source: str, files: list[str], split: str = "train") -> list[Path]:
        """The preference pairs' files: the sample set's ``split`` (train or heldout) parquet, or
        the data files of a dataset directory (matching ``files`` globs when given), or one local file."""
        if source == SAMPLE:
            return [self.sample() / "preference" / f"preference_{split}.parquet"]
        return data_files(self.fetch(source, "dataset"), files, source)

    def prompt_file(self, source: str, files: list[str], split: str = "train") -> Path:
        """GRPO's prompt file: the sample set's RL prompts of ``split`` (train or heldout), or
        the one data file of a dataset directory (matching ``files`` globs when given), or a
        local file."""
        if source == SAMPLE:
            return self.sample() / "rl" / f"rl_{split}.jsonl"
        found = data_files(self.fetch(source, "dataset"), files, source)
        if len(found) != 1:
            raise ValueError(f"prompts {source}: {len(found)} data files {[str(f) for f in found][:4]}, expected one "
                             "(name it with data_files)")
        return found[0]

    def pretraining_text(self, source: str, files: list[str]) -> list[Path]:
        """The text corpus files: the sample's Wikipedia-layout parquet, or a dataset's data files."""
        if source == SAMPLE:
            return [self.sample() / "pretrain" / "corpus.parquet"]
        return data_files(self.fetch(source, "dataset"), files, source)

    def benchmark_data(self, benchmark: str, source: str) -> str:
        """A benchmark's data as its evaluation stage takes it: the sample's copy for "sample",
        else the source (hub sources the stage downloads itself)."""
        if source != SAMPLE:
            return source
        return str(self.sample() / ("mmlu/hf" if benchmark == "mmlu" else benchmark))


def data_files(path: Path, globs: list[str], source: str) -> list[Path]:
    """``path`` itself when a file, else its data files (matching ``globs`` when given)."""
    if path.is_file():
        return [path]
    if globs:
        found = sorted({f for pattern in globs for f in path.glob(pattern) if f.is_file()})
    else:
        found = sorted(f for f in path.rglob("*") if f.suffix in DATA_SUFFIXES and f.name != "manifest.json")
    if not found:
        wanted = f"files matching {globs}" if globs else f"data files ({', '.join(DATA_SUFFIXES)})"
        raise FileNotFoundError(f"data {source!r}: {path} holds no {wanted}")
    return found
