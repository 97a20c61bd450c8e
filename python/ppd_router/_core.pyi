"""Type stubs of the Rust extension ``ppd_router._core``.

Checked against the built extension by ``python -m mypy.stubtest ppd_router._core``
(scripts/test.sh); the TypedDicts and aliases below exist only here, for the
shapes of returned dicts (tests/stubtest-allowlist.txt names them).
"""

from os import PathLike
from types import TracebackType
from typing import Any, Literal, Optional, TypedDict, Union, final

from typing_extensions import Self

__version__: str
PATHS: list[str]
REASONS: list[str]

class PpdError(Exception):
    """Base class of every error ppd_router raises."""

class ConfigError(PpdError, ValueError):
    """An invalid setting or name."""

class TableError(PpdError, ValueError):
    """A lookup table failed to load or validate."""

class BadRequest(PpdError, ValueError):
    """A request body cannot be routed."""

class InvalidArgument(PpdError, ValueError):
    """An argument out of its range (a count, a rate, a time)."""

class RunError(PpdError, RuntimeError):
    """A router, emulator or cluster failed to start, run or stop."""

class TokenizerError(PpdError, OSError):
    """A tokenizer file could not be read or loaded."""

class FileError(PpdError, OSError):
    """A file could not be written."""

# --- the shared vocabulary (rust/ppd-core: layout, catalog, builtin) ---

ROLES: list[str]
"""Node roles: "P", "D", "pD", "R"."""
ROLE_SETTINGS: dict[str, str]
"""Role -> the router setting that lists its nodes ("P" -> "prefill", ...)."""
PAPER_CONTEXT_BINS: list[int]
PAPER_CONTEXT_NAMES: list[str]
PAPER_QPS: list[float]
PAPER_WORKLOADS: list[tuple[str, int, int]]
"""The nine Turn-2 workload types as (name, n_in, n_out)."""
T1_CONTEXTS: list[tuple[str, int, int]]
"""Turn-1 contexts of the synthetic workloads as (name, n_in, n_out)."""
SYNTHETIC_WORKLOADS: list[str]
"""The 18 synthetic two-turn workloads, small_tiny ... large_huge_paste."""
PAPER_CONFIGS: list[tuple[str, str]]
"""The paper's 17 deployments with the policy that realises each."""
BUILTIN_TABLES: list[tuple[str, int, int]]
"""The shipped tables as (name, prefill nodes, decode nodes)."""

def parse_layout(layout: str) -> list[str]:
    """The roles of a layout, e.g. ``parse_layout("1P_1D_2pD") == ["P", "D", "pD", "pD"]``."""

def nearest_table(layout: str) -> str:
    """The spec (``builtin:NAME``) of the shipped table nearest a layout's share of prefill nodes."""

PathName = Literal["pd", "local", "replica"]

class CellRef(TypedDict):
    context: str
    workload: str
    qps: float

class ScoredCell(CellRef):
    distance: float
    requested: CellRef
    d_ttft: float
    d_tpot: float

@final
class TokenCounter:
    @staticmethod
    def word_rule() -> TokenCounter: ...
    @staticmethod
    def from_tokenizer_json(path: str) -> TokenCounter: ...
    def count(self, text: str) -> int: ...
    @property
    def name(self) -> str: ...

def count_tokens(text: str) -> int:
    """Tokens of ``text`` under the word rule shared with the emulator."""

@final
class Table:
    @staticmethod
    def load(path: Union[str, PathLike[str]]) -> Table:
        """Load and validate a ``ppd-table/1`` file; raises TableError naming file, cell and field."""
    @staticmethod
    def from_spec(spec: str) -> Table:
        """Load ``builtin:NAME`` (a shipped table) or a file path."""
    @staticmethod
    def from_json(text: str, name: str = "<string>") -> Table: ...
    def to_json(self) -> str: ...
    def save(self, path: Union[str, PathLike[str]]) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def deployment(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def hardware(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def default_n_out(self) -> int: ...
    @property
    def context_classes(self) -> list[str]: ...
    @property
    def context_bins(self) -> list[int]: ...
    @property
    def workloads(self) -> list[tuple[str, int, int]]: ...
    @property
    def qps_levels(self) -> list[float]: ...
    @property
    def cells(self) -> list[dict[str, Any]]: ...
    def representative_context(self, class_index: int) -> int: ...
    def lookup(self, n_ctx: int, n_in: int, n_out: int, qps: float) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

@final
class Route:
    @property
    def path(self) -> PathName: ...
    @property
    def reason(self) -> str: ...
    @property
    def score(self) -> Optional[float]: ...
    @property
    def cell(self) -> Optional[ScoredCell]: ...
    @property
    def forecast(self) -> Optional[dict[str, dict[str, float]]]:
        """Per path (`pd`, `local`, `pull`): predicted `ttft_ms`, the `tpot_added_ms` its prefill adds to each
        of the `corunners` decoding on D, D's `base_tpot_ms`, and the `tpot_burden` Equation 1 weighs."""
    def to_dict(self) -> dict[str, Any]: ...

@final
class DecisionEngine:
    def __new__(
        cls,
        table: Table,
        policy: str = "ppd",
        w_ttft: float = 1.0,
        w_tpot: float = 1.0,
        *,
        profile: str = "default",
        slo_ttft_ms: Optional[float] = None,
        slo_tpot_ms: Optional[float] = None,
    ) -> Self: ...
    def decide(
        self,
        turn: int,
        n_in: int,
        n_out: int,
        n_ctx: int,
        qps: float,
        *,
        conversation_id: Optional[str] = None,
        has_session: bool = True,
        d_available: bool = True,
        d_overloaded: bool = False,
        d_local_capable: bool = True,
        replica_share: float = 0.0,
        session_on_replica: bool = False,
        kv_lost: bool = False,
        cached_tokens: Optional[int] = None,
        prefix_mismatch: bool = False,
        pull_ready: bool = False,
        live: Optional[str] = None,
    ) -> Route:
        """Route one request (Algorithm 1, Phase 2, plus session and node vetoes)."""
    def set_weights(self, w_ttft: float, w_tpot: float) -> None: ...
    def set_table(self, table: Table) -> None: ...
    def set_policy(self, policy: str) -> None: ...
    @property
    def weights(self) -> tuple[float, float]: ...
    @property
    def policy(self) -> str: ...
    @property
    def table(self) -> Table: ...

class SessionInfo(TypedDict):
    id: str
    turns: int
    p: Optional[str]
    d: Optional[str]
    context_tokens: Optional[int]
    mean_output_tokens: Optional[int]
    created_ms: int
    last_access_ms: int

@final
class SessionTable:
    def __new__(
        cls, ttl_s: float = 3600.0, capacity: int = 1_000_000, shards: int = 64, max_bytes: int = 268_435_456
    ) -> Self: ...
    def get(self, conversation_id: str, now: Optional[float] = None) -> Optional[SessionInfo]: ...
    def record_turn(
        self,
        conversation_id: str,
        *,
        turn: int,
        d: str,
        p: Optional[str] = None,
        prompt_tokens: Optional[int] = None,
        completion_tokens: Optional[int] = None,
        now: Optional[float] = None,
    ) -> SessionInfo: ...
    def reassign(self, node: str, to: Optional[str] = None) -> int: ...
    def evict_expired(self, now: Optional[float] = None) -> int: ...
    def remove(self, conversation_id: str) -> bool: ...
    def page(self, offset: int = 0, limit: int = 100) -> list[tuple[str, SessionInfo]]: ...
    def stats(self) -> dict[str, int]: ...
    def __len__(self) -> int: ...

class RequestFeatures(TypedDict):
    conversation_id: str
    id_source: str
    turn: int
    n_in: int
    n_ctx: int
    n_out: int
    ctx_source: str
    out_source: str

def identify(
    body: Union[str, bytes],
    session_header: Optional[str] = None,
    *,
    counter: Optional[TokenCounter] = None,
    sessions: Optional[SessionTable] = None,
    default_n_out: int = 128,
    session_from_user: bool = False,
) -> RequestFeatures: ...

@final
class QpsEstimator:
    def __new__(cls, window_s: float = 10.0, buckets: int = 100) -> Self: ...
    def record(self, now: Optional[float] = None) -> None: ...
    def rate(self, now: Optional[float] = None) -> float: ...

@final
class Router:
    """The Rust router server: the TOML file at ``config_path`` (if any), overridden by
    ``settings_json`` (settings of ``ppd-router serve`` by TOML key), validated once."""
    def __new__(cls, settings_json: str = "{}", *, config_path: Optional[Union[str, PathLike[str]]] = None) -> Self: ...
    def serve(self) -> None:
        """Run in the foreground (GIL released) until SIGINT or SIGTERM."""
    def start(self) -> str:
        """Start on a background thread; returns the URL once it accepts connections."""
    def stop(self) -> None: ...
    @property
    def url(self) -> Optional[str]: ...
    def register_node(self, url: str, role: str, zmq_address: Optional[str] = None, source: str = "zmq") -> bool: ...
    def deregister_node(self, url: str) -> int: ...
    @property
    def upstream_api_key(self) -> Optional[str]:
        """The bearer token the router sends to every node (``upstream_api_key``, its file, or
        ``PPD_UPSTREAM_API_KEY``), for ``launch`` to start its nodes with; None when unset."""
    def nodes_json(self) -> str: ...

def validate_router_config(
    settings_json: str = "{}", *, config_path: Optional[Union[str, PathLike[str]]] = None
) -> str:
    """The settings with defaults filled in, as JSON; raises ConfigError naming the bad field
    (and its line, for a value from the file)."""

# --- engine emulator and virtual-time simulator (rust/ppd-py/src/emulator.rs) ---

def run_emulator(
    role: str = "R",
    port: int = 8000,
    *,
    host: str = "127.0.0.1",
    profile: Optional[str] = None,
    kv_link_gbps: Optional[float] = None,
    max_num_seqs: Optional[int] = None,
    max_num_batched_tokens: Optional[int] = None,
    kv_blocks: Optional[int] = None,
    seed: int = 0,
    served_model_name: Optional[str] = None,
    fault_latency_ms: float = 0.0,
    fault_error_rate: float = 0.0,
    fault_hang: bool = False,
    kv_events_endpoint: Optional[str] = None,
    kv_events_bind: bool = False,
    kv_connector_extra_config: Optional[str] = None,
    api_key: Optional[str] = None,
) -> None:
    """Runs one emulator node until SIGINT/SIGTERM (returns None) or a failure (raises)."""

@final
class EmulatedCluster:
    """Emulator nodes running in this process on free 127.0.0.1 ports."""
    @property
    def urls(self) -> list[str]: ...
    @property
    def specs(self) -> list[str]:
        """The nodes as router settings name them: `URL;kv_events=tcp://...` for decoding nodes."""
    @property
    def roles(self) -> list[str]:
        """Layout roles in order: "P", "D", "pD" or "R"."""
    def shutdown(self) -> None:
        """Stops every node (graceful) and joins their runtime; idempotent."""
    def __enter__(self) -> EmulatedCluster: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
        /,
    ) -> Literal[False]: ...

def start_emulated_cluster(
    layout: str,
    *,
    profile: Optional[str] = None,
    kv_link_gbps: Optional[float] = None,
    max_num_seqs: Optional[int] = None,
    max_num_batched_tokens: Optional[int] = None,
    kv_blocks: Optional[int] = None,
    seed: int = 0,
    served_model_name: Optional[str] = None,
    kv_connector_extra_config: Optional[str] = None,
) -> EmulatedCluster:
    """Starts the nodes of ``layout`` (e.g. "2P2pD", "1P_1D_2pD", "4R") in this process."""

def load_profile(name_or_path: str) -> str:
    """A profile (built-in name or TOML path) as JSON."""

def simulate(config_json: str, profile: Optional[str] = None, table: Optional[str] = None) -> str:
    """Runs one simulated point; ``config_json`` holds SimConfig's fields, the result is JSON.

    ``table`` is a path or ``builtin:h100-2P2pD`` (default for ``ppd``: ``nearest_table``);
    the result names the table used in ``table``.
    """

def simulator_catalog() -> tuple[list[str], list[str], list[float]]:
    """Names the simulator knows: the paper's workloads, configurations and QPS levels."""
