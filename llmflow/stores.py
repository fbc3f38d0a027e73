"""Where ``llmflow server`` keeps its state: Prefect's database, MLflow's backend store and
MLflow's artifact store.

By default both databases are SQLite files in the workspace (``prefect/prefect.db`` and
``mlflow.db``) and the artifacts a directory beside them. With ``--database`` both go to one
PostgreSQL server, in two databases: Prefect in the database the URL names, MLflow in
``{name}_mlflow`` beside it (created when missing, if the role may create databases), or in
the one ``--mlflow-database`` names. They never share one: Prefect and MLflow each migrate
their schema with alembic, and both keep their revision in a table named ``alembic_version``.

Each server gets only its own database URL, in its environment (never on a command line a
process listing shows, never in the environment of the worker and the flow runs it starts);
what is printed has the password masked.
"""

from __future__ import annotations

import importlib.util
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

MLFLOW_SUFFIX = "_mlflow"
"""MLflow's database is Prefect's name with this suffix unless --mlflow-database names one."""
POSTGRES_SCHEMES = ("postgresql", "postgres")
PREFECT_DRIVER = "postgresql+asyncpg"
"""Prefect's server only runs on asyncpg (installed with prefect)."""
MLFLOW_DRIVER = "postgresql+psycopg2"
"""MLflow's store on psycopg2 (psycopg2-binary), SQLAlchemy's default PostgreSQL driver."""
CONNECT_TIMEOUT_S = 5
# Artifact stores that MLflow's server can write to, with the module each needs there.
OBJECT_STORES = {"s3": ("boto3", "boto3"), "gs": ("google.cloud.storage", "google-cloud-storage")}
PG_IDENTIFIER_MAX = 63
URL_SHAPE = "expected postgresql://USER:PASSWORD@HOST:PORT/DATABASE"


@dataclass(frozen=True)
class Postgres:
    """A PostgreSQL database: where it is, as whom to connect, which database."""

    host: str
    port: int
    user: str
    password: str | None
    dbname: str

    @classmethod
    def parse(cls, url: str, option: str) -> Postgres:
        """A ``postgresql://user:password@host:port/dbname`` URL (user and password
        percent-encoded; a ``+driver`` after the scheme is ignored); a ValueError naming
        ``option`` when it is not one. Error messages never repeat the password."""
        try:
            parts = make_url(url.strip())
        except ArgumentError:  # nothing like scheme://...
            raise ValueError(f"{option}: no scheme, not postgresql://; {URL_SHAPE}") from None
        except ValueError as error:  # a port that is not a number
            raise ValueError(f"{option}: not a PostgreSQL URL ({error}); {URL_SHAPE}") from None
        scheme = parts.get_backend_name().lower()
        if scheme not in POSTGRES_SCHEMES:
            raise ValueError(f"{option}: {scheme} scheme, not postgresql://; {URL_SHAPE}")
        # SQLAlchemy keeps a #fragment in the database name.
        if parts.query or "#" in (parts.database or ""):
            raise ValueError(f"{option}: no ?parameters or #fragment in the URL: set TLS with libpq's environment "
                             "(PGSSLMODE, PGSSLROOTCERT: both servers' drivers read them); " + URL_SHAPE)
        if not parts.host:
            raise ValueError(f"{option}: no host in the URL; {URL_SHAPE}")
        if not parts.username:
            raise ValueError(f"{option}: no user in the URL; {URL_SHAPE}")
        # SQLAlchemy leaves the database name percent-encoded; PostgreSQL's names are literal.
        dbname = unquote(parts.database or "")
        if not dbname or "/" in dbname:
            raise ValueError(f"{option}: no database name after the host; {URL_SHAPE}")
        if len(dbname.encode()) + len(MLFLOW_SUFFIX) > PG_IDENTIFIER_MAX:
            raise ValueError(f"{option}: database name {dbname!r} is too long (PostgreSQL names are at most "
                             f"{PG_IDENTIFIER_MAX} bytes, and {MLFLOW_SUFFIX!r} is added for MLflow's)")
        return cls(parts.host, parts.port or 5432, parts.username, parts.password, dbname)

    def url(self, scheme: str = "postgresql", mask: bool = False) -> str:
        """The URL with ``scheme`` (``postgresql+asyncpg`` for a driver); ``mask`` hides the password."""
        return URL.create(scheme, self.user, self.password, self.host, self.port,
                          self.dbname).render_as_string(hide_password=mask)

    def __str__(self) -> str:
        return self.url(mask=True)

    def __repr__(self) -> str:
        return f"Postgres({self.url(mask=True)!r})"

    def same_server(self, other: Postgres) -> bool:
        return (self.host, self.port) == (other.host, other.port)

    def connect(self, option: str, dbname: str | None = None):
        """A psycopg2 connection (autocommit) to this database, or to ``dbname`` on the same
        server; a ValueError naming ``option`` with libpq's reason when it cannot be opened."""
        import psycopg2

        name = dbname or self.dbname
        try:
            connection = psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password,
                                          dbname=name, connect_timeout=CONNECT_TIMEOUT_S,
                                          application_name="llmflow server")
        except psycopg2.Error as error:
            reason = " ".join(str(error).split()) or type(error).__name__
            if self.password:  # libpq never repeats it, but make sure
                reason = reason.replace(self.password, "***")
            raise ValueError(f"{option}: cannot connect to {replace(self, dbname=name)}: {reason}") from None
        connection.autocommit = True
        return connection


@dataclass(frozen=True)
class Stores:
    """The stores ``llmflow server`` starts its servers on."""

    prefect: Postgres | None
    """Prefect's database; None: SQLite in the workspace (PREFECT_HOME)."""
    mlflow: Postgres | None
    """MLflow's backend store; None: {workspace}/mlflow.db."""
    artifacts: str
    """MLflow's artifact store: an absolute directory or an object-store URI."""
    workspace: Path
    mlflow_option: str = "--database"
    """The option that named MLflow's database (--mlflow-database, or --database it derives from)."""

    def prefect_env(self) -> dict[str, str]:
        """What the Prefect server's environment needs (nothing for SQLite: PREFECT_HOME decides)."""
        if self.prefect is None:
            return {}
        return {"PREFECT_SERVER_DATABASE_CONNECTION_URL": self.prefect.url(PREFECT_DRIVER)}

    def mlflow_backend(self) -> str:
        """MLflow's ``--backend-store-uri``, password included: give it through the environment
        (MLFLOW_BACKEND_STORE_URI), never on a command line."""
        if self.mlflow is None:
            return f"sqlite:///{self.workspace / 'mlflow.db'}"
        return self.mlflow.url(MLFLOW_DRIVER)

    def describe(self) -> list[tuple[str, str]]:
        """(what, where) of each store, passwords masked, for the start-up lines."""
        prefect = str(self.prefect) if self.prefect else f"SQLite {self.workspace / 'prefect' / 'prefect.db'}"
        mlflow = str(self.mlflow) if self.mlflow else f"SQLite {self.workspace / 'mlflow.db'}"
        return [("Prefect DB", prefect), ("MLflow DB", mlflow), ("artifacts", self.artifacts)]


def artifact_root(value: str | None, workspace: Path) -> str:
    """MLflow's artifact store: ``{workspace}/mlartifacts`` by default, else a directory (a
    shared path on a cluster), a ``file://`` URI, or an object-store URI (``s3://bucket/prefix``,
    ``gs://bucket/prefix``) whose client library the MLflow server needs. Checks the shape
    only: nothing reaches the object store."""
    if not value:
        return str(workspace / "mlartifacts")
    value = value.strip()
    parts = urlsplit(value)
    scheme = parts.scheme.lower()
    if scheme in OBJECT_STORES:
        module, package = OBJECT_STORES[scheme]
        if not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"--artifact-root: expected {scheme}://BUCKET/PREFIX")
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise ValueError(f"--artifact-root: {scheme}:// artifact stores need {package} where the MLflow server "
                             f"runs: pip install {package}")
        return f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError("--artifact-root: expected file:///ABSOLUTE/PATH")
        value = unquote(parts.path)
    elif len(scheme) > 1 or "://" in value:
        stores = " or ".join(f"{s}://BUCKET/PREFIX" for s in OBJECT_STORES)
        raise ValueError(f"--artifact-root: {scheme or 'a'}:// URI is not an artifact store llmflow server starts "
                         f"MLflow with: give a directory (a shared path on a cluster), {stores}")
    path = Path(value).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--artifact-root: cannot create {path}: {error.strerror or error}") from None
    return str(path)


def resolve(workspace: Path, database: str | None, mlflow_database: str | None,
            artifacts: str | None) -> Stores:
    """The stores the options name, their shapes checked (nothing is reached yet)."""
    if mlflow_database and not database:
        raise ValueError("--mlflow-database: give --database too (Prefect's PostgreSQL database); "
                         "without it both stores are SQLite files in the workspace")
    prefect = Postgres.parse(database, "--database") if database else None
    mlflow, mlflow_option = None, "--database"
    if prefect is not None:
        if mlflow_database:
            mlflow_option = "--mlflow-database"
            mlflow = Postgres.parse(mlflow_database, "--mlflow-database")
            if mlflow.same_server(prefect) and mlflow.dbname == prefect.dbname:
                raise ValueError(f"--mlflow-database: {mlflow.dbname} is Prefect's database (--database): Prefect and "
                                 "MLflow each need a database of their own (both keep an alembic_version table)")
        else:
            mlflow = replace(prefect, dbname=prefect.dbname + MLFLOW_SUFFIX)
    return Stores(prefect, mlflow, artifact_root(artifacts, workspace), workspace, mlflow_option)


def prepare(stores: Stores) -> list[str]:
    """Check that both PostgreSQL databases can be used by their role, creating MLflow's when
    it is missing on Prefect's server and Prefect's role may create databases. Returns what was
    done (for the start-up lines). A ValueError naming the option says what is wrong."""
    if stores.prefect is None or stores.mlflow is None:
        return []
    import psycopg2
    from psycopg2 import sql

    prefect, mlflow, option = stores.prefect, stores.mlflow, stores.mlflow_option
    done = []
    with closing(prefect.connect("--database")) as connection, connection.cursor() as cursor:
        _check_may_create_tables(cursor, prefect, "--database")
        if mlflow.same_server(prefect) and mlflow.user == prefect.user:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (mlflow.dbname,))
            if cursor.fetchone() is None:
                cursor.execute("SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user")
                row = cursor.fetchone()
                if not (row and row[0]):
                    raise ValueError(
                        f"{option}: MLflow's database {mlflow.dbname} does not exist and role {mlflow.user} may not "
                        f"create databases: create it (CREATE DATABASE {mlflow.dbname} OWNER {mlflow.user}) or "
                        "name another with --mlflow-database")
                try:
                    cursor.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(mlflow.dbname)))
                except psycopg2.errors.DuplicateDatabase:  # created meanwhile
                    pass
                except psycopg2.Error as error:
                    raise ValueError(f"{option}: cannot create MLflow's database {mlflow.dbname}: "
                                     f"{' '.join(str(error).split())}") from None
                else:
                    done.append(f"created MLflow's database {mlflow.dbname}")
    with closing(mlflow.connect(option)) as connection, connection.cursor() as cursor:
        _check_may_create_tables(cursor, mlflow, option)
    return done


def _check_may_create_tables(cursor, database: Postgres, option: str) -> None:
    """Prefect and MLflow create their tables in schema public on first start (PostgreSQL 15
    lets only the database's owner do that by default)."""
    cursor.execute("SELECT has_schema_privilege(current_user, 'public', 'CREATE')")
    if not cursor.fetchone()[0]:
        raise ValueError(f"{option}: role {database.user} may not create tables in database {database.dbname} "
                         f"(schema public): make the role its owner (ALTER DATABASE {database.dbname} OWNER TO "
                         f"{database.user}) or GRANT CREATE ON SCHEMA public TO {database.user}")
