"""``llmflow probe compare TARGET BENCH --out DIR``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_settings import CliApp, CliSubCommand

from llmflow.probe.compare.tables import CompareConfig, compare_dumps


class CompareCommand(CompareConfig):
    """Compare a dump against a benchmark dump with msprobe's metrics and results; writes
    compare_result_{rank}.csv and advisor.txt into --out and prints the advice."""

    def cli_cmd(self) -> None:
        report = compare_dumps(CompareConfig(**self.model_dump()))
        print(report.advice, end="")
        print(f"wrote {', '.join(r.csv for r in report.ranks)} and advisor.txt in {report.out}")


class ProbeCommands(BaseModel):
    """Debug precision with msprobe-format dumps."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    compare: CliSubCommand[CompareCommand]
    """Compare a dump against a benchmark dump (msprobe's metrics and results) and name the first divergence."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
