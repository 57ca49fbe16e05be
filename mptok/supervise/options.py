"""Every option of ``mptok serve``, declared once.

Each ``ServeOptions`` field is one option: its name, type and default, and,
through ``option(...)``, its flag, parser (which validates), help text and
the component that uses it (``Use``). The command line (``mptok.cli``), the
supervisor's options and what each frontend receives
(``mptok.serve.launch.FrontendSettings`` carries the ``ServeOptions``) are all
derived from these fields, and a frontend hands the options of a component to
it as keyword arguments (``ServeOptions.arguments_for``), so adding an option
is one field here plus the parameter that uses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from mptok.core.settings import CHOICES, parse_bytes
from mptok.routing.policy import PATIENCE_FACTOR, PATIENCE_FLOOR_S, POLICIES, ROUTE_TIMEOUT_S


class Use(enum.Enum):
    """Where an option's value goes.

    SUPERVISOR and FRONTEND options are read by name (``options.host``);
    the others are passed as keyword arguments, named ``Option.argument``, to
    the component a frontend builds: ``TokenizationOwners`` (ROUTING),
    ``TokenizeService`` (SERVICE), ``CacheConfig.from_env`` (CACHE).
    """

    SUPERVISOR = "supervisor"
    FRONTEND = "frontend"
    ROUTING = "routing"
    SERVICE = "service"
    CACHE = "cache"


def bounded(kind: type, allows: Callable[[Any], bool], allowed: str) -> Callable[[str], Any]:
    """A parser of a number of ``kind`` (int or float) that ``allows``; ``allowed`` says which, for the error."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not allows(value):  # every bound below refuses nan and inf: a comparison with nan is false
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value" for a word that is no number, not this name
    return parse


_positive_int = bounded(int, lambda v: v >= 1, "at least 1")
_non_negative_int = bounded(int, lambda v: v >= 0, "0 or more")
_port = bounded(int, lambda v: 0 <= v <= 65535, "0 to 65535")
_patience = bounded(float, lambda v: 0 <= v <= 1000, "0 (off) to 1000")
# Longer waits are surely a typo, and infinite ones overflow the timers they reach.
_MAX_SECONDS = 86_400.0
parse_seconds = bounded(float, lambda v: 0 < v <= _MAX_SECONDS, f"more than 0 and at most {_MAX_SECONDS:,.0f} seconds")


def _bytes(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return value


@dataclass(frozen=True)
class Option:
    """How one ``ServeOptions`` field is given on the command line and where it goes.

    ``parse`` turns one word into the value (raising ``ArgumentTypeError`` or ``ValueError`` for a bad one); None
    makes a flag without a value (default False). ``many`` takes one or more words (a tuple). ``argument`` is the
    keyword the component of ``use`` takes it as (default: the field's name); ``choices``, the only words accepted.
    ``--help`` adds "(default: ...)" to ``help`` unless it says its default itself or the option is a flag.
    """

    flag: str
    parse: Callable[[str], Any] | None
    metavar: str | None
    help: str
    use: Use
    argument: str | None = None
    many: bool = False
    choices: tuple[str, ...] = ()


def option(*declared: Any, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING, **more: Any) -> Any:
    """A ``ServeOptions`` field that is a command-line option: ``Option``'s fields, and the field's default."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"option": Option(*declared, **more)})


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``mptok serve`` is told on its command line; picklable (it reaches
    every frontend). Fields in the order ``--help`` lists them."""

    frontends: int = option(
        "--frontends", _positive_int, "N", "frontend processes (default: the number of CPUs, here %(default)s)",
        use=Use.SUPERVISOR, default_factory=lambda: os.cpu_count() or 1,
    )
    host: str = option("--host", str, "HOST", "address to listen on", use=Use.FRONTEND, default="127.0.0.1")
    # Once the supervisor has bound it, the port actually listened on (never 0).
    port: int = option("--port", _port, "PORT", "TCP port; 0 picks a free one, named in the ready line", use=Use.FRONTEND, default=8000)
    tokenizer: str | None = option(
        "--tokenizer", str, "PATH",
        "a tokenizer.json file or a directory holding one (and tokenizer_config.json); "
        "default: the embedded DeepSeek V3-family tokenizer",
        use=Use.FRONTEND, default=None,
    )
    # Read (and checked) by the supervisor; frontends get its source (FrontendSettings.chat_template).
    chat_template_file: str | None = option(
        "--chat-template", str, "FILE",
        'Jinja chat template for {"messages": ...} requests; default: the tokenizer\'s own, '
        "else the built-in DeepSeek V3 template when the tokenizer has its special tokens",
        use=Use.SUPERVISOR, default=None,
    )
    max_prompt_chars: int = option(
        "--max-prompt-chars", _positive_int, "N", "longest prompt (after the chat template) in characters; longer ones get 413",
        use=Use.SERVICE, default=4_000_000,
    )
    cache_bytes: int | None = option(
        "--cache-bytes", _bytes, "SIZE",
        "memory each frontend's prefix cache may hold for its conversations (text, ids, offsets, "
        "versions, keys), e.g. 512M or 2G; default: MPTOK_CACHE_MAX_BYTES, else 512MiB",
        use=Use.CACHE, argument="max_bytes", default=None,
    )
    tokenizer_backend: str | None = option(
        "--tokenizer-backend", str, "NAME",
        "what tokenizes prompts in full: auto (the cheapest of fastokens, gigatoken and tokenizers that gives "
        "identical ids on a start-up check), tokenizers, fastokens or gigatoken; default: "
        "MPTOK_CACHE_TOKENIZER_BACKEND, else auto",
        use=Use.CACHE, default=None, choices=CHOICES,
    )
    threads: int = option("--threads", _positive_int, "N", "tokenizing threads per frontend", use=Use.SERVICE, default=4)
    affinity_chars: int = option(
        "--affinity-chars", _non_negative_int, "N",
        "route a raw prompt that carries no conversation id by a hash of its first N characters "
        "(0: such prompts are not routed); right only when those characters differ between "
        "conversations: prompts sharing a longer prefix all go to one frontend. Chats without an id "
        "are always routed by their first messages",
        use=Use.SERVICE, default=0,
    )
    routing: str | None = option(
        "--routing", str, "POLICY",
        "which prompts go to their conversation's owner: kept (those of conversations this frontend "
        "keeps no copy of), always, or never (a cache per frontend); default: MPTOK_ROUTING, else kept",
        use=Use.ROUTING, default=None, choices=POLICIES,
    )
    route_timeout_s: float = option(
        "--route-timeout", parse_seconds, "S", "seconds a frontend waits for the conversation's owner before tokenizing the prompt itself",
        use=Use.ROUTING, argument="timeout_s", default=ROUTE_TIMEOUT_S,
    )
    route_backoff_s: float = option(
        "--route-backoff", parse_seconds, "S", "seconds an owner that timed out is then skipped",
        use=Use.ROUTING, argument="backoff_s", default=10.0,
    )
    route_patience: float = option(
        "--route-patience", _patience, "X",
        "when this frontend holds a fingerprint of a conversation (and asks its owner only for what changed), an owner that has not answered "
        f"within {PATIENCE_FLOOR_S:g} s plus X times what tokenizing the whole prompt here would take is treated "
        "as timed out (0: wait for --route-timeout)",
        use=Use.ROUTING, argument="patience_factor", default=PATIENCE_FACTOR,
    )
    # Also the supervisor's: it kills frontends still running _EXIT_MARGIN_S after it.
    graceful_timeout_s: float = option(
        "--graceful-timeout", parse_seconds, "S",
        "on SIGTERM/SIGINT, seconds a frontend's whole stop gets (in-flight requests first, "
        "then its pool and its peers); frontends still running 5 s later are killed",
        use=Use.FRONTEND, default=10.0,
    )
    startup_timeout_s: float = option(
        "--startup-timeout", parse_seconds, "S", "seconds every frontend gets to become ready at start-up", use=Use.SUPERVISOR, default=120.0,
    )
    max_restarts: int = option(
        "--max-restarts", _non_negative_int, "N", "a frontend that exits more than N times within --restart-window is given up: a crash loop",
        use=Use.SUPERVISOR, default=5,
    )
    restart_window_s: float = option(
        "--restart-window", parse_seconds, "S", "seconds over which --max-restarts counts exits", use=Use.SUPERVISOR, default=60.0,
    )
    max_in_flight: int = option(
        "--max-in-flight", _positive_int, "N",
        "/tokenize requests one frontend holds at once (reading, queued, tokenizing); more get 503 with Retry-After at once",
        use=Use.SERVICE, default=16,
    )
    queue_timeout_s: float = option(
        "--queue-timeout", parse_seconds, "S", "seconds a request may wait for a tokenizing thread; then 503 with Retry-After",
        use=Use.SERVICE, default=2.0,
    )
    read_timeout_s: float = option(
        "--read-timeout", parse_seconds, "S",
        "seconds a client gets to send a whole request, headers and body, from its first byte; then 408 and the connection is closed",
        use=Use.FRONTEND, default=10.0,
    )
    max_connections: int = option(
        "--max-connections", _positive_int, "N", "open connections per frontend; beyond, 503 at once", use=Use.FRONTEND, default=1024,
    )
    max_messages: int = option(
        "--max-messages", _positive_int, "N", 'most "messages" in one request; more get 413', use=Use.SERVICE, default=4096,
    )
    given_up_retry_s: float = option(
        "--given-up-retry", parse_seconds, "S", "seconds after which a frontend given up for crash-looping is tried again",
        use=Use.SUPERVISOR, default=300.0,
    )
    # vLLM's options, spelled as ``vllm serve`` spells them.
    max_model_len: int | None = option(
        "--max-model-len", _positive_int, "N",
        "the context length /tokenize reports as max_model_len; longer prompts get 400 as in vLLM "
        "(default: the tokenizer's model_max_length when it is a real limit, else none)",
        use=Use.SERVICE, default=None,
    )
    served_model_names: tuple[str, ...] = option(
        "--served-model-name", str, "NAME",
        'model names requests may give in "model"; any other gets vLLM\'s 404 (default: any name is accepted)',
        use=Use.SERVICE, default=(), many=True,
    )
    enable_tokenizer_info_endpoint: bool = option(
        "--enable-tokenizer-info-endpoint", None, None,
        "serve GET /tokenizer_info (the tokenizer's configuration and chat template), as vLLM's option does",
        use=Use.FRONTEND, default=False,
    )

    def __post_init__(self) -> None:
        # argparse gives lists; a tuple keeps the options hashable.
        for field, declared in declared_options():
            if declared.many:
                object.__setattr__(self, field.name, tuple(getattr(self, field.name)))

    def arguments_for(self, use: Use) -> dict[str, Any]:
        """The keyword arguments the component of ``use`` takes these options as.

        An option at None (not given, with no default of its own) is left
        out, so the component's own default applies: for ``Use.CACHE``, its
        ``MPTOK_CACHE_*`` variable, then ``CacheConfig``'s default.
        """
        return {
            declared.argument or field.name: getattr(self, field.name)
            for field, declared in declared_options()
            if declared.use is use and getattr(self, field.name) is not None
        }


def declared_options() -> list[tuple[dataclasses.Field, Option]]:
    """Every ``ServeOptions`` field that is a command-line option, in ``--help`` order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(ServeOptions) if "option" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
    """One argument of ``parser`` per option (per option whose field is in ``only``, when given:
    another server's command that shares the supervisor's); ``ServeOptions(**vars(parsed))`` then holds them."""
    defaults = ServeOptions()
    for field, declared in declared_options():
        if only is not None and field.name not in only:
            continue
        default = getattr(defaults, field.name)
        if declared.parse is None:
            parser.add_argument(declared.flag, dest=field.name, action="store_true", default=default, help=declared.help)
            continue
        help_text = declared.help if "default" in declared.help else f"{declared.help} (default: %(default)s)"
        parser.add_argument(
            declared.flag, dest=field.name, type=declared.parse, metavar=declared.metavar, nargs="+" if declared.many else None,
            choices=declared.choices or None, default=default, help=help_text,
        )
