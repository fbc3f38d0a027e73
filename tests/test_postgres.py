"""``llmflow server --database``: Prefect's server and MLflow's tracking server on a real
PostgreSQL (tests/postgres.py), each in a database of its own; the options' checks before
anything starts; and the finetune-eval/on-demand deployment run end to end on such a server,
its flow run in Prefect's database and its MLflow runs in MLflow's, nothing in SQLite."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from urllib.parse import quote

import postgres
import psutil
import pytest
from postgres import DATABASE, PASSWORD, ROLE
from prefect_helpers import task_states, wait_for_flow_run
from server_process import free_port, log_tails, running_server

from llmflow.cli import main
from llmflow.stores import MLFLOW_DRIVER, PREFECT_DRIVER, Postgres, artifact_root, prepare, resolve

postgres_server = postgres.postgres_server  # the fixture (tests/postgres.py)

# --- URLs and artifact roots: shapes only, nothing reached ---------------------------------------


def test_a_postgres_url_gives_prefect_its_database_and_mlflow_one_beside_it(tmp_path):
    url = f"postgresql://{ROLE}:{quote(PASSWORD, safe='')}@db.example:6543/{DATABASE}"
    stores = resolve(tmp_path, url, None, None)
    assert stores.prefect == Postgres("db.example", 6543, ROLE, PASSWORD, DATABASE)
    assert stores.mlflow == Postgres("db.example", 6543, ROLE, PASSWORD, f"{DATABASE}_mlflow")
    assert stores.artifacts == str(tmp_path / "mlartifacts")
    # The drivers each server runs on; the password round-trips through percent-encoding.
    prefect_url = stores.prefect_env()["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert prefect_url.startswith(f"{PREFECT_DRIVER}://{ROLE}:")
    assert stores.mlflow_backend().startswith(f"{MLFLOW_DRIVER}://{ROLE}:")
    from sqlalchemy.engine import make_url

    for url_with_driver in (prefect_url, stores.mlflow_backend()):
        parsed = make_url(url_with_driver)
        assert (parsed.password, parsed.host, parsed.port) == (PASSWORD, "db.example", 6543)
    assert make_url(prefect_url).database == DATABASE
    assert make_url(stores.mlflow_backend()).database == f"{DATABASE}_mlflow"
    # What is printed has the password masked.
    shown = " ".join(where for _, where in stores.describe())
    assert PASSWORD not in shown and quote(PASSWORD, safe="") not in shown
    assert f"postgresql://{ROLE}:***@db.example:6543/{DATABASE}" in shown
    assert PASSWORD not in repr(stores)


def test_sqlite_in_the_workspace_stays_the_default(tmp_path):
    stores = resolve(tmp_path, None, None, None)
    assert stores.prefect is None and stores.mlflow is None and stores.prefect_env() == {}
    assert stores.mlflow_backend() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert prepare(stores) == []


def test_an_explicit_mlflow_database_is_used_and_never_prefects_own(tmp_path):
    prefect = "postgres://u:p@h/pf"
    stores = resolve(tmp_path, prefect, "postgresql+psycopg2://m:q@h2:5433/tracking", None)
    assert stores.prefect == Postgres("h", 5432, "u", "p", "pf")
    assert stores.mlflow == Postgres("h2", 5433, "m", "q", "tracking")
    assert stores.mlflow_option == "--mlflow-database"
    with pytest.raises(ValueError, match=r"^--mlflow-database: pf is Prefect's database .*alembic_version"):
        resolve(tmp_path, prefect, "postgresql://other:x@h:5432/pf", None)
    with pytest.raises(ValueError, match=r"^--mlflow-database: give --database too"):
        resolve(tmp_path, None, "postgresql://m:q@h/tracking", None)


@pytest.mark.parametrize(("url", "why"), [
    ("mysql://u:p@h/db", "mysql scheme, not postgresql://"),
    ("llmflow", "no scheme, not postgresql://"),
    ("postgresql://u:p@h:port/db", "not a PostgreSQL URL"),
    ("postgresql://u:p@/db", "no host"),
    ("postgresql://h:5432/db", "no user"),
    ("postgresql://u:p@h:5432", "no database name"),
    ("postgresql://u:p@h:5432/db?sslmode=require", "PGSSLMODE"),
    ("postgresql://u:p@h/" + "d" * 60, "too long"),
])
def test_a_malformed_database_url_is_refused_naming_the_option_and_never_its_password(tmp_path, url, why):
    with pytest.raises(ValueError) as error:
        resolve(tmp_path, url, None, None)
    message = str(error.value)
    assert message.startswith("--database: ") and why in message and "\n" not in message
    assert ":p@" not in message


def test_artifact_roots(tmp_path, monkeypatch):
    assert artifact_root(str(tmp_path / "shared" / "artifacts"), tmp_path) == str(tmp_path / "shared" / "artifacts")
    assert (tmp_path / "shared" / "artifacts").is_dir()
    assert artifact_root((tmp_path / "uri").as_uri(), tmp_path) == str(tmp_path / "uri")
    for bad, why in [("s3://", "expected s3://BUCKET/PREFIX"), ("ftp://host/x", "ftp:// URI is not an artifact store"),
                     ("file://host/x", "expected file:///ABSOLUTE/PATH")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            artifact_root(bad, tmp_path)
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ValueError, match=r"^--artifact-root: cannot create .*/file/sub"):
        artifact_root(str(blocked / "sub"), tmp_path)
    # An object store needs its client library where the MLflow server runs; nothing is reached.
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real_find_spec(name, *a) if name != "boto3"
                        else object())
    assert artifact_root("s3://bucket/llmflow/", tmp_path) == "s3://bucket/llmflow"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "boto3"
                        else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"^--artifact-root: s3:// artifact stores need boto3 .*pip install boto3"):
        artifact_root("s3://bucket/llmflow", tmp_path)


def test_an_unreachable_database_stops_llmflow_server_in_one_line_before_anything_starts(tmp_path, capsys):
    workspace = tmp_path / "ws"
    url = f"postgresql://{ROLE}:{quote(PASSWORD, safe='')}@127.0.0.1:{free_port()}/{DATABASE}"
    with pytest.raises(SystemExit) as exit_:
        main(["server", "--database", url, "--workspace", str(workspace)])
    message = str(exit_.value.code)
    assert re.fullmatch(rf"llmflow server: --database: cannot connect to postgresql://{ROLE}:\*\*\*@127\.0\.0\.1:"
                        rf"\d+/{DATABASE}: .*(refused|Connection).*", message), message
    assert PASSWORD not in message and quote(PASSWORD, safe="") not in message
    assert not workspace.exists()  # nothing was started, nothing written


# --- the checks against a real PostgreSQL, before the servers start (a second each) ---------------


def test_mlflows_database_is_created_beside_prefects_when_the_role_may(postgres_server, tmp_path):
    postgres_server.psql(f"CREATE DATABASE fresh OWNER {ROLE}")
    stores = resolve(tmp_path, postgres_server.url("fresh"), None, None)
    assert prepare(stores) == ["created MLflow's database fresh_mlflow"]
    owner = postgres_server.psql("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'fresh_mlflow'")
    assert owner == [[ROLE]]
    assert prepare(stores) == []  # there already


def test_what_the_role_may_not_do_is_said_before_anything_starts(postgres_server, tmp_path):
    postgres_server.psql("CREATE ROLE plain LOGIN PASSWORD 'plainpw'")
    postgres_server.psql("CREATE DATABASE plaindb OWNER plain")
    with pytest.raises(ValueError, match=r"^--database: MLflow's database plaindb_mlflow does not exist and role plain "
                                         r"may not create databases: create it .* or name another with "
                                         r"--mlflow-database$"):
        prepare(resolve(tmp_path, postgres_server.url("plaindb", "plain", "plainpw"), None, None))
    # A database the role does not own: PostgreSQL 15 lets it create no table there.
    with pytest.raises(ValueError, match=r"^--database: role plain may not create tables in database llmflow"):
        prepare(resolve(tmp_path, postgres_server.url(DATABASE, "plain", "plainpw"), None, None))
    with pytest.raises(ValueError) as error:
        prepare(resolve(tmp_path, postgres_server.url(password="wrong-pw"), None, None))
    assert re.match(rf"--database: cannot connect to postgresql://{ROLE}:\*\*\*@127\.0\.0\.1:\d+/{DATABASE}: .*"
                    rf"password authentication failed for user \"{ROLE}\"", str(error.value)), error.value
    assert "wrong-pw" not in str(error.value)
    with pytest.raises(ValueError, match=r"^--mlflow-database: cannot connect to .*/nowhere: .*does not exist"):
        prepare(resolve(tmp_path, postgres_server.url(), postgres_server.url("nowhere", "plain", "plainpw"), None))


def test_the_password_may_come_from_pgpassword_instead_of_the_command_line(postgres_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    stores = resolve(tmp_path, postgres_server.url(password=None), None, None)
    assert stores.prefect.password is None and ":" not in stores.mlflow_backend().split("@")[0].split("//")[1]
    prepare(stores)


# --- llmflow server on PostgreSQL, a deployment run end to end ----------------------------------

RUN_TIMEOUT_S = 400
# Seconds of training on one CPU worker, with a checkpoint half-way; a few MMLU questions.
PARAMETERS = {"train": {"steps": 8, "save_interval": 4, "micro_batch_size": 8, "global_batch_size": 8},
              "evaluation": {"limit": 8}, "version": "postgres-1", "register_min_gain": None}
STAGES = ("sample", "convert", "tokenize-instruction", "eval-mmlu", "train", "export", "infer", "register")


def _memory_mb(pids: list[int]) -> dict[str, float]:
    """Proportional memory (PSS, MB: shared pages split between their processes) of the process
    trees of ``pids``, by program."""
    usage: dict[str, float] = {}
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                name = " ".join(Path(a).name for a in p.cmdline()[1:3]).strip() or p.name()
                usage[name] = usage.get(name, 0) + p.memory_full_info().pss / 2**20
    return usage


@pytest.fixture
def server_on_postgres(postgres_server, tmp_path):
    """``llmflow server --database ... --artifact-root ...`` with a workspace of its own on free
    loopback ports; this process's Prefect client talks to it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    workspace, artifacts = tmp_path / "ws", tmp_path / "shared" / "mlartifacts"
    started = time.monotonic()
    with running_server(workspace, "--database", postgres_server.url(), "--artifact-root", str(artifacts),
                        unset=("PREFECT_", "MLFLOW_", "PG")) as server:
        print(f"llmflow server on PostgreSQL up in {time.monotonic() - started:.0f} s:", *server.lines, sep="\n")
        with temporary_settings(updates={PREFECT_API_URL: f"{server.url}/api"}):
            yield {"proc": server.proc, "lines": server.lines, "workspace": workspace, "artifacts": artifacts,
                   "mlflow": server.mlflow_url}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # includes starting the servers and migrating both databases
def test_a_deployment_run_on_a_postgres_backed_server_is_recorded_in_postgres(postgres_server, server_on_postgres):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    server, workspace = server_on_postgres, server_on_postgres["workspace"]
    shown = "\n".join(server["lines"])
    assert f"Prefect DB:  postgresql://{ROLE}:***@127.0.0.1:{postgres_server.port}/{DATABASE}" in shown
    assert f"MLflow DB:   postgresql://{ROLE}:***@127.0.0.1:{postgres_server.port}/{DATABASE}_mlflow" in shown
    assert f"artifacts:   {server['artifacts']}" in shown

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("finetune-eval/on-demand")
        run_id = str(client.create_flow_run_from_deployment(deployment.id, parameters=PARAMETERS).id)
    started = time.monotonic()
    run = wait_for_flow_run(run_id, RUN_TIMEOUT_S)
    postmaster = [p.pid for p in psutil.process_iter(["cmdline"])
                  if str(postgres_server.root) in " ".join(p.info["cmdline"] or []) and "postgres" in p.name()]
    print(f"flow run {run.state.name} in {time.monotonic() - started:.0f} s; proportional memory (MB):",
          {k: round(v) for k, v in _memory_mb([server["proc"].pid, *postmaster]).items()})
    assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{log_tails(workspace)}"
    assert {name: set(states) for name, states in task_states(run_id).items()} == {
        stage: {"Completed"} for stage in STAGES}

    # Prefect's state is in PostgreSQL: the flow run, its task runs, the deployments.
    (row,) = postgres_server.psql(f"SELECT state_type, deployment_id FROM flow_run WHERE id = '{run_id}'", DATABASE)
    assert row == ["COMPLETED", str(deployment.id)]
    (tasks,) = postgres_server.psql(f"SELECT count(*) FROM task_run WHERE flow_run_id = '{run_id}' "
                                    "AND state_type = 'COMPLETED'", DATABASE)
    assert int(tasks[0]) >= len(STAGES) + 1  # eval-mmlu runs twice
    # Two databases, each with its own alembic revision; MLflow's tables only in MLflow's.
    assert {DATABASE, f"{DATABASE}_mlflow"} <= postgres_server.databases()
    prefect_revision = postgres_server.psql("SELECT version_num FROM alembic_version", DATABASE)
    mlflow_revision = postgres_server.psql("SELECT version_num FROM alembic_version", f"{DATABASE}_mlflow")
    assert len(prefect_revision) == len(mlflow_revision) == 1 and prefect_revision != mlflow_revision
    tables = "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
    prefect_tables = {r[0] for r in postgres_server.psql(tables, DATABASE)}
    mlflow_tables = {r[0] for r in postgres_server.psql(tables, f"{DATABASE}_mlflow")}
    assert {"flow_run", "deployment"} <= prefect_tables and not {"runs", "metrics"} & prefect_tables
    assert {"runs", "metrics", "experiments"} <= mlflow_tables and "flow_run" not in mlflow_tables

    # MLflow's runs, as its server reports them: the flow's parent run and every stage nested.
    client = MlflowClient(server["mlflow"])
    experiment = client.get_experiment_by_name("llmflow-finetune-eval")
    (parent,) = client.search_runs([experiment.experiment_id], f"tags.`llmflow.flow_run_id` = '{run_id}'")
    scores = {key: parent.data.metrics[key] for key in ("mmlu_before", "mmlu_after")}
    assert all(0 <= score <= 1 for score in scores.values()), scores
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {r.data.tags["llmflow.stage"] for r in children} == set(STAGES)
    # ... and as PostgreSQL holds them.
    stored = postgres_server.psql(f"SELECT key, value FROM metrics WHERE run_uuid = '{parent.info.run_id}' "
                                  "AND key IN ('mmlu_before', 'mmlu_after')", f"{DATABASE}_mlflow")
    assert {key: float(value) for key, value in stored} == scores
    in_postgres = {r[0] for r in postgres_server.psql(
        f"SELECT run_uuid FROM tags WHERE key = 'mlflow.parentRunId' AND value = '{parent.info.run_id}'",
        f"{DATABASE}_mlflow")}
    assert in_postgres == {r.info.run_id for r in children}
    assert postgres_server.psql("SELECT name FROM registered_models", f"{DATABASE}_mlflow") == [["llmflow-finetuned"]]

    # The artifacts went to the artifact root, through the MLflow server.
    assert list(server["artifacts"].rglob("loss_curve.png")) and list(server["artifacts"].rglob("config.json"))
    assert not (workspace / "mlartifacts").exists()
    # Nothing in SQLite.
    assert list(workspace.rglob("*.db")) == [] and list(Path.cwd().glob("mlflow.db")) == []
    # The password is nowhere to be read: not in the output, the logs or a command line, and only
    # the servers have their database's URL in their environment (not the worker or the flows).
    secrets = (PASSWORD, quote(PASSWORD, safe=""))
    logs = "".join(log.read_text(errors="replace") for log in (workspace / "logs").glob("*.log"))
    assert not [s for s in secrets if s in shown or s in logs]
    checked = []
    for child in psutil.Process(server["proc"].pid).children():
        args = child.cmdline()  # python .../prefect server start ..., python .../mlflow server ...
        is_server = len(args) > 2 and Path(args[1]).name in ("prefect", "mlflow") and args[2] == "server"
        for p in [child, *child.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                cmdline, environ = " ".join(p.cmdline()), p.environ()
                assert not [s for s in secrets if s in cmdline], cmdline
                if not is_server:
                    assert not [k for k, v in environ.items() if any(s in v for s in secrets)], cmdline
                    checked.append(cmdline)
    assert any(" worker start " in cmdline for cmdline in checked), checked
