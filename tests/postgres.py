"""A real PostgreSQL server for the tests of ``llmflow server --database``: a throwaway cluster
(Debian's PostgreSQL, installed by ``make system-packages``) in a temporary directory, on a
free loopback port, with password (SCRAM) authentication on 127.0.0.1 and a login role that
owns one database and may create more, as a deployment's DBA would set it up.

PostgreSQL refuses to run as root: as root, the cluster belongs to the ``postgres`` system
user and every server program runs as that user (``runuser``). Tests that use the fixture are
skipped, saying why, only when PostgreSQL's programs are not installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from server_process import free_port

ROLE = "llmflow"
# Characters a URL must percent-encode, so that the tests prove they are handled.
PASSWORD = "s3cret:/@%?#pw"
DATABASE = "llmflow"


def postgres_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/N/bin`` holding initdb, pg_ctl and psql."""
    found = [d for d in Path("/usr/lib/postgresql").glob("*/bin")
             if all((d / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres", "psql"))]
    found.sort(key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    return found[-1] if found else None


@dataclass
class PostgresServer:
    """A running throwaway PostgreSQL cluster."""

    bin: Path
    root: Path
    port: int
    as_owner: list[str]
    """The prefix that runs a program as the cluster's owner (runuser as root, else nothing)."""
    host: str = "127.0.0.1"

    @property
    def socket_dir(self) -> Path:
        return self.root / "socket"

    def url(self, dbname: str = DATABASE, user: str = ROLE, password: str | None = PASSWORD) -> str:
        """postgresql://user:password@127.0.0.1:port/dbname, percent-encoded."""
        credentials = quote(user, safe="") + (f":{quote(password, safe='')}" if password is not None else "")
        return f"postgresql://{credentials}@{self.host}:{self.port}/{dbname}"

    def psql(self, sql: str, dbname: str = "postgres") -> list[list[str]]:
        """Rows of ``sql`` run as the superuser over the Unix socket (unaligned, tab-separated)."""
        done = subprocess.run(
            [*self.as_owner, str(self.bin / "psql"), "-X", "-v", "ON_ERROR_STOP=1", "-h", str(self.socket_dir),
             "-p", str(self.port), "-U", "postgres", "-d", dbname, "-At", "-F", "\t", "-c", sql],
            capture_output=True, text=True, check=False,
        )
        if done.returncode:
            raise RuntimeError(f"psql -c {sql!r} on {dbname} failed ({done.returncode}): {done.stderr.strip()}")
        return [line.split("\t") for line in done.stdout.splitlines()]

    def databases(self) -> set[str]:
        return {row[0] for row in self.psql("SELECT datname FROM pg_database WHERE NOT datistemplate")}


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL cluster for the session: role ``llmflow`` (password ``PASSWORD``, may
    create databases, not a superuser) owning database ``llmflow``. Stopped and deleted at the
    end."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): `make system-packages` "
                    "installs Debian's postgresql")
    as_owner: list[str] = []
    # Under /tmp, not pytest's tmp_path (0700 under /tmp/pytest-of-root): the owner must reach it.
    root = Path(tempfile.mkdtemp(prefix="llmflow-pg-", dir="/tmp"))
    if os.geteuid() == 0:
        as_owner = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres", "postgres")
    server = PostgresServer(bin_dir, root, free_port(), as_owner)
    started = False
    try:
        (root / "pwfile").write_text("unused\n")  # initdb's superuser password (the socket trusts it)
        if as_owner:
            shutil.chown(root / "pwfile", "postgres", "postgres")
        _run([*as_owner, str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", "postgres", "--no-sync",
              "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={root / 'pwfile'}", "-E", "UTF8",
              "--locale=C"], "initdb")
        _run([*as_owner, "mkdir", str(server.socket_dir)], "mkdir")
        options = (f"-p {server.port} -k {server.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c shared_buffers=32MB")
        _run([*as_owner, str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-o", options, "-l",
              str(root / "postgres.log"), "-w", "-t", "60", "start"], "pg_ctl start")
        started = True
        server.psql(f"CREATE ROLE {ROLE} LOGIN CREATEDB PASSWORD '{PASSWORD}'")
        server.psql(f"CREATE DATABASE {DATABASE} OWNER {ROLE}")
        yield server
    finally:
        if started:
            with contextlib.suppress(Exception):
                _run([*as_owner, str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-m", "fast", "-w", "stop"],
                     "pg_ctl stop")
        shutil.rmtree(root, ignore_errors=True)
