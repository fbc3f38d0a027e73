"""The Prefect UI end to end, in headless Chromium: ``llmflow server`` (Prefect server, work
pool, deployments, process worker, MLflow) on loopback; the finetune-eval/on-demand deployment
run from its parameter form, its last evaluation failing, then retried with the flow run
page's Retry button, finishing with every earlier stage Cached, its two expert-parallel ranks'
expert load in MLflow and its export a Qwen3-MoE transformers loads; then a Qwen3.5 (Gated
DeltaNet and gated attention layers) run from the same form.

Chromium and its driver come from Debian (``chromium``, ``chromium-driver``), installed by
``make browser`` (a step of ``make test``); Selenium drives the system chromedriver and never
downloads anything. Without a browser the test fails: it is never skipped.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from prefect_helpers import attempt_task_states, flow_run_logs, mlflow_runs, wait_for_flow_run
from selenium import webdriver
from selenium.common.exceptions import (
    ElementClickInterceptedException,
    ElementNotInteractableException,
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait
from server_process import Server, log_tails, running_server
from transformers import AutoModelForCausalLM

from llmflow.tracking import experiment_name

pytestmark = pytest.mark.slow

CHROMIUM = "chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
RUN_TIMEOUT_S = 240
# Small enough for a few seconds of training on two CPU workers (one expert-parallel group of
# two), with a checkpoint half-way.
TRAIN = {"Steps": 8, "Save Interval": 4, "Micro Batch Size": 4, "Global Batch Size": 8, "Nproc": 2, "Ep": 2}
SMALL_TRAIN = {"Steps": 2, "Micro Batch Size": 4, "Global Batch Size": 4, "Nproc": 1}


# --- the browser -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> tuple[str, str]:
    """Paths of Chromium and its chromedriver (``make test`` installs them from Debian)."""
    browser = shutil.which(CHROMIUM)
    if not (browser and Path(CHROMEDRIVER).is_file()):
        pytest.fail(
            f"the browser test needs Chromium and {CHROMEDRIVER}: `make browser` installs Debian's "
            "`chromium` and `chromium-driver` packages (`make test` runs it first)",
            pytrace=False,
        )
    return browser, CHROMEDRIVER


@pytest.fixture
def browser(chromium, monkeypatch):
    """A headless Chromium session (1400x1000) on the system chromedriver."""
    binary, driver_path = chromium
    # Selenium Manager (the driver downloader) stays off: the driver's path is given explicitly.
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def screenshots_on_failure(driver, out: Path):
    """On a failure, a screenshot and the page's HTML in ``out``."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            driver.save_screenshot(str(out / "failure.png"))
            (out / "failure.html").write_text(driver.page_source)
            print(f"browser at {driver.current_url}; screenshot and HTML in {out}")
            # The console names the UI's failed API requests (its "Oops. Something went wrong." toast).
            print("browser console:", *(str(entry) for entry in driver.get_log("browser")[-30:]), sep="\n")
        raise


# --- llmflow server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llmflow_server(tmp_path_factory):
    """``llmflow server`` with a workspace of its own on free loopback ports."""
    with running_server(tmp_path_factory.mktemp("browser") / "ws") as server:
        assert any(line.startswith(f"Prefect UI:  {server.url} ") for line in server.lines)
        yield server


@pytest.fixture
def prefect_api(llmflow_server):
    """The Prefect client of this process talks to the server's API."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: f"{llmflow_server.url}/api"}):
        yield


# --- the Prefect UI (3.8's Vue UI; selectors checked against its DOM) --------------------------

# A field of the parameter form: its label sits in the property's own header, its input in its body.
PROPERTY = "div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')]"


def _own_properties(context, label: str) -> list[WebElement]:
    """Form properties labelled ``label`` directly inside ``context`` (not in nested sections)."""
    matches = context.find_elements(
        By.XPATH,
        f".//{PROPERTY}[./div[contains(@class, 'p-label__header')]"
        f"//span[contains(@class, 'schema-form-property__label')]"
        f"[normalize-space()='{label}' or normalize-space()='{label} (Optional)']]",
    )
    if context.tag_name == "html":
        return matches
    return [m for m in matches if m.find_element(By.XPATH, f"./ancestor::{PROPERTY}[1]") == context]


def form_field(driver, path: list[str]) -> WebElement:
    """The property at ``path`` of labels, e.g. ["train", "Steps"]."""
    context = driver.find_element(By.TAG_NAME, "html")
    for label in path:
        found = _own_properties(context, label)
        if len(found) != 1:
            raise NoSuchElementException(f"{len(found)} form fields labelled {label!r} at {path}")
        context = found[0]
    return context


def _body(prop: WebElement) -> WebElement:
    return prop.find_element(By.XPATH, "./div[contains(@class, 'p-label__body')]")


def set_field(driver, path: list[str], value, variant: str | None = None) -> None:
    """Type ``value`` into the field at ``path``; ``variant`` first picks the type of an
    optional field ("int", "str": the buttons of an ``X | None`` field)."""
    prop = form_field(driver, path)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", prop)
    if variant is not None:
        choice = _body(prop).find_element(
            By.XPATH, f"./div[contains(@class, 'p-button-group')]/button[normalize-space()='{variant}']"
        )
        if choice.get_attribute("aria-selected") != "true":
            choice.click()
    # Picking a variant renders the property anew: look it up again until its input is there.
    rendered = WebDriverWait(driver, 10, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    control = rendered.until(lambda d: _body(form_field(d, path)).find_element(By.CSS_SELECTOR, "input, textarea"))
    control.click()
    control.send_keys(Keys.CONTROL, "a")
    control.send_keys(str(value))
    assert control.get_attribute("value") == str(value), (path, control.get_attribute("value"))


def click(driver, text: str, timeout_s: float = 30, within: str = "") -> None:
    """Click the button reading ``text`` (inside the element at XPath ``within``), once it is
    clickable and no longer moving (toasts and menus slide in: a click mid-animation lands on
    another element)."""
    locator = (By.XPATH, f"{within}//button[normalize-space()='{text}']")

    def clicked(d) -> bool:
        EC.element_to_be_clickable(locator)(d).click()
        return True

    WebDriverWait(driver, timeout_s, poll_frequency=0.25, ignored_exceptions=(
        AttributeError, ElementClickInterceptedException, ElementNotInteractableException, NoSuchElementException,
        StaleElementReferenceException,
    )).until(clicked, f"no clickable button {text!r}")


def open_deployment(driver, url: str, flow: str, deployment: str) -> None:
    """From the deployments list to the page of ``flow``/``deployment``."""
    driver.get(f"{url}/deployments")
    link = WebDriverWait(driver, 60).until(EC.element_to_be_clickable((
        By.XPATH, f"//tr[.//a[normalize-space()='{flow}']]//a[normalize-space()='{deployment}']",
    )))
    link.click()
    WebDriverWait(driver, 30).until(EC.url_matches(r"/deployments/deployment/[0-9a-f-]{36}($|\?)"))
    WebDriverWait(driver, 30).until(EC.presence_of_element_located((
        By.XPATH, (f"//header[contains(@class, 'page-heading')][.//*[normalize-space()='{deployment}']]"
                   f"[.//a[normalize-space()='{flow}']]"),
    )))


def custom_run(driver, server: Server, run_name: str, fields: list[tuple[list[str], object, str | None]]) -> str:
    """Run -> Custom run on the deployment page, fill ``fields``, submit; once the API has the
    new flow run, return its id."""
    click(driver, "Run")
    click(driver, "Custom run", 10)
    WebDriverWait(driver, 60, ignored_exceptions=(NoSuchElementException,)).until(
        lambda d: form_field(d, ["train", "Steps"])
    )
    name = driver.find_element(
        By.XPATH, "//div[contains(@class, 'p-label')][./div/label[normalize-space()='Run Name']]//input"
    )
    name.send_keys(Keys.CONTROL, "a")
    name.send_keys(run_name)
    # The deployment's own parameter is already in the form: the server's workspace.
    workspace = _body(form_field(driver, ["workspace"])).find_element(By.CSS_SELECTOR, "textarea, input")
    assert workspace.get_attribute("value") == str(server.workspace)
    for path, value, variant in fields:
        set_field(driver, path, value, variant)
    return submit_until_created(driver, run_name)


def wait_then_open(driver, server: Server, run_id: str, **wait):
    """Wait for the flow run to finish (``wait_for_flow_run``'s options) with the browser on a
    blank page, then open the run's page; the finished run. (The run page redraws its live
    graph and logs while the run goes on: Chromium took 122 CPU-seconds with it open, 88 this
    way in a run twice as long.)"""
    driver.get("about:blank")
    run = wait_for_flow_run(run_id, RUN_TIMEOUT_S, **wait)
    driver.get(f"{server.url}/runs/flow-run/{run_id}")
    return run


def submit_until_created(driver, run_name: str) -> str:
    """Click the form's Submit until the API has the flow run; return its id."""

    def submit() -> None:
        button = driver.find_element(By.XPATH, "//form//button[@type='submit'][normalize-space()='Submit']")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", button)
        # The toast of a refused attempt (the 503 below) stays over the button until it is
        # closed: the button itself is clicked, as the user does after closing it.
        driver.execute_script("arguments[0].click()", button)

    return until_accepted(driver, submit, lambda: _flow_run_id(run_name), "create_flow_run",
                          f"a flow run named {run_name!r}")


def until_accepted(driver, act, accepted, endpoint: str, what: str, attempts: int = 3, timeout_s: float = 120):
    """Do the UI action ``act`` until ``accepted()`` is truthy; return that value.

    On SQLite, Prefect's API reads and then writes in one deferred transaction: when another
    writer (the worker's poll, the event persister) commits in between, SQLite answers
    SQLITE_BUSY_SNAPSHOT at once and the API returns 503. Prefect's Python client retries a 503;
    its UI shows an error toast and stays put, and the user does it again, as this does when the
    console shows a 503 from ``endpoint``."""
    for _ in range(attempts):
        act()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := accepted():
                return value
            refused = [e["message"] for e in driver.get_log("browser") if endpoint in e["message"] and " 503 " in e["message"]]
            if refused:
                print("the API refused the action with 503, doing it again:", refused[0])
                break
            time.sleep(1)
        else:
            raise TimeoutException(f"no {what} in the API {timeout_s:.0f} s after the UI action")
    raise AssertionError(f"the API refused {attempts} UI actions for {what} with 503")


def _flow_run(run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def _flow_run_id(name: str) -> str | None:
    """The id of the flow run named ``name``, once the API has it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    assert len(runs) <= 1, f"{len(runs)} flow runs named {name!r}"
    return str(runs[0].id) if runs else None


def shown_state(driver, name: str, timeout_s: float = 60) -> None:
    """Wait until the flow run page's heading shows the state ``name``."""
    badge = f"//span[contains(@class, 'state-badge')][normalize-space()='{name}']"
    WebDriverWait(driver, timeout_s).until(EC.visibility_of_element_located((
        By.XPATH, f"//header[contains(@class, 'page-heading')]{badge}",
    )))


def small_run(version: str, model: Path, **evaluation) -> list[tuple[list[str], object, str | None]]:
    fields = [(["model"], model, None)]
    fields += [(["train", label], value, "int" if label == "Save Interval" else None) for label, value in TRAIN.items()]
    fields += [(["evaluation", label.title()], value, None) for label, value in evaluation.items()]
    fields += [(["evaluation", "Limit"], 8, "int"), (["version"], version, "str")]
    return fields


def registered(run_id: str) -> bool:
    """Whether the flow run's last registry gate passed (the flow logs its verdict; the run's
    last log lines can reach the API shortly after its state does)."""
    deadline = time.monotonic() + 60
    while not (verdicts := [line for line in flow_run_logs(run_id) if line.startswith("registry gate: ")]):
        assert time.monotonic() < deadline, f"flow run {run_id} logged no registry gate"
        time.sleep(1)
    return not verdicts[-1].endswith("not registered")


# --- the test ----------------------------------------------------------------------------------


@pytest.mark.timeout(900)  # includes starting the servers
def test_ui_runs_finetune_eval_and_its_retry_skips_finished_stages(llmflow_server, prefect_api, browser, sample_assets,
                                                                  sample_tokenizer_model, tmp_path):
    server = llmflow_server
    model = sample_tokenizer_model("qwen3_moe", num_key_value_heads=2, head_dim=16, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    with screenshots_on_failure(browser, tmp_path):
        # 1. The on-demand finetune-and-eval, run from its parameter form with its MMLU data
        # going bad once training has saved a checkpoint (the base model was scored before
        # training): every stage runs, and the final evaluation fails.
        data = tmp_path / "mmlu"
        shutil.copytree(sample_assets() / "mmlu" / "hf", data)
        victim = next(data.rglob("test-*.parquet"))
        backup = tmp_path / "backup.parquet"
        shutil.copy2(victim, backup)
        checkpoints_before = set(server.workspace.glob("runs/*/step_*"))
        corrupted, finished = threading.Event(), threading.Event()

        def corrupt_once_training_saved() -> None:
            while not finished.wait(0.1):
                if set(server.workspace.glob("runs/*/step_*")) - checkpoints_before:
                    victim.write_bytes(b"not a parquet file")
                    corrupted.set()
                    return

        corrupter = threading.Thread(target=corrupt_once_training_saved, daemon=True)
        corrupter.start()
        open_deployment(browser, server.url, "finetune-eval", "on-demand")
        run_id = custom_run(browser, server, "browser-e2e-retried", small_run("browser-2", model, data=data))
        try:
            run = wait_then_open(browser, server, run_id)
        finally:
            finished.set()
            corrupter.join()
        assert corrupted.is_set(), f"no new checkpoint in {server.workspace / 'runs'}; the run is {run.state.name}"
        assert run.state.is_failed(), f"{run.state.name}: {run.state.message}"
        assert run.parameters["train"]["steps"] == 8 and run.parameters["version"] == "browser-2"
        assert run.parameters["model"] == str(model) and run.parameters["train"]["ep"] == 2
        assert run.parameters["evaluation"]["limit"] == 8 and run.parameters["evaluation"]["data"] == str(data)
        assert run.parameters["workspace"] == str(server.workspace)
        first = attempt_task_states(run_id, 1)
        # The finetuned model's benchmark follows its export: the prompts' answers come after it.
        assert first == {
            "sample": ["Completed"], "convert": ["Completed"], "tokenize-instruction": ["Completed"],
            "eval-mmlu": ["Completed", "Failed"], "train": ["Completed"], "export": ["Completed"],
        }, first
        shown_state(browser, "Failed")

        # 2. The data restored as it was (bytes and mtime: the base score's cache key holds), the
        # Retry button of the flow run page runs the same flow run again: only the failed stage
        # and what follows it execute.
        shutil.copy2(backup, victim)
        failed_state = run.state.id

        def retry() -> None:
            click(browser, "Retry", 30, within="//header[contains(@class, 'page-heading')]")
            click(browser, "Retry", 10, within="//div[@role='dialog']")

        until_accepted(browser, retry, lambda: _flow_run(run_id).state.id != failed_state, "set_state",
                       f"a new state of flow run {run_id}")
        run = wait_then_open(browser, server, run_id, not_state_id=failed_state)
        assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{log_tails(server.workspace)}"
        assert run.run_count == 2
        retry = attempt_task_states(run_id, 2)
        assert retry == {
            "sample": ["Cached"], "convert": ["Cached"], "tokenize-instruction": ["Cached"],
            "eval-mmlu": ["Cached", "Completed"], "train": ["Cached"], "export": ["Cached"], "infer": ["Completed"],
            **({"register": ["Completed"]} if registered(run_id) else {}),
        }, retry
        shown_state(browser, "Completed")
        # Trained by two expert-parallel ranks, the experts' load logged, exported in the
        # per-expert layout transformers loads as the family's class.
        (run_dir,) = server.workspace.glob("runs/*")
        assert json.loads((run_dir / "train_config.json").read_text())["ep"] == 2
        (train_run,) = mlflow_runs({"mlflow_uri": server.mlflow_url, "experiment": experiment_name("finetune-eval")},
                                   "train")
        assert {"moe_aux_loss", "moe_max_expert_load", "expert_tokens/0", "expert_tokens/3"} <= set(train_run.data.metrics)
        (exported,) = server.workspace.glob("models/*")
        assert type(AutoModelForCausalLM.from_pretrained(exported)).__name__ == "Qwen3MoeForCausalLM"

        # 3. The same form with a Qwen3.5 (Gated DeltaNet layers and gated attention), one
        # process: every stage runs. (A dense Qwen3 runs every stage from the command line:
        # tests/test_flows.py.)
        family = "qwen3_5_text"
        path = sample_tokenizer_model(family, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                      layer_types=["linear_attention", "full_attention"])
        open_deployment(browser, server.url, "finetune-eval", "on-demand")
        fields = [(["model"], path, None), (["version"], f"browser-{family}", "str"), (["evaluation", "Limit"], 4, "int"),
                  *((["train", label], value, None) for label, value in SMALL_TRAIN.items())]
        run_id = custom_run(browser, server, f"browser-{family}", fields)
        run = wait_then_open(browser, server, run_id)
        assert run.state.is_completed(), f"{family}: {run.state.name}: {run.state.message}\n{log_tails(server.workspace)}"
        assert run.parameters["model"] == str(path)
        stages = attempt_task_states(run_id, 1)
        assert {"convert", "tokenize-instruction", "eval-mmlu", "train", "export", "infer"} <= set(stages), stages
        assert all(state in ("Completed", "Cached") for states in stages.values() for state in states), stages
        shown_state(browser, "Completed")
