"""``inference-gateway sim``: start N simulated engines on ports P..P+N-1 (or the ``--ports`` listed) in one process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from typing import Any

import uvloop

from gateway.kv_events.engine_hashes import HashAlgorithm
from loadtests.sim.faults import Fault, FaultMode
from loadtests.sim.kvcache import CacheScope, VllmHashingSpec
from loadtests.sim.profiles import ProfileKind, get_profile, profile_names
from loadtests.sim.serve import serve_engines
from loadtests.sim.tokenizer import HfTokenization
from loadtests.sim.usage_report import AnswerFormat

DEFAULT_HASH_ALGO = HashAlgorithm.SHA256  # vLLM's --prefix-caching-hash-algo default


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``sim`` sub-command."""
    parser = subparsers.add_parser("sim", help="run simulated vLLM engines", description=__doc__)
    parser.add_argument("--profile", required=True, choices=profile_names())
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="port of the first engine (the others follow it)")
    where.add_argument(
        "--ports", type=_ports, help="one port per engine, comma-separated (instead of --port and --count)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--count", type=int, default=1, help="number of engines (consecutive ports)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every simulated duration by K")
    parser.add_argument("--model", default=None, help="served model name (default: the profile's model)")
    parser.add_argument("--ttft-ms", type=float, default=None, help="fixed profile: time to first token")
    parser.add_argument("--itl-ms", type=float, default=None, help="fixed profile: inter-token delay")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's --gpu-memory-utilization, which sizes the KV cache (default: the profile's, 0.9)",
    )
    parser.add_argument(
        "--cache-scope",
        choices=[s.value for s in CacheScope],
        default=None,
        help="what the prefix cache holds: pool (vLLM's block pool, the default), slots (llama.cpp's server "
        "with --cache-ram 0: each slot keeps its last prompt until reused), running (a sequence's prefix "
        "is gone when it ends); see loadtests/sim/kvcache.py",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="running sequences per engine (vLLM's --max-num-seqs; llama.cpp's --parallel slots)",
    )
    parser.add_argument(
        "--answer-format",
        choices=[f.value for f in AnswerFormat],
        default=AnswerFormat.VLLM.value,
        help="how answers report usage and the prompt tokens reused: vllm (prompt_tokens_details), llamacpp "
        "(prompt_tokens_details always, and timings with cache_n), llamacpp-legacy (llama.cpp before PR #19361: "
        "timings only); see loadtests/sim/usage_report.py",
    )
    parser.add_argument(
        "--no-prompt-tokens-details",
        dest="prompt_tokens_details",
        action="store_false",
        help="answer as vLLM started without --enable-prompt-tokens-details: no cached_tokens (vllm format only)",
    )
    parser.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        default=None,
        help="publish KV-cache events as vLLM does (ZeroMQ PUB bound here, e.g. tcp://127.0.0.1:5557; engine I on "
        "the port + I); see loadtests/sim/kv_events.py",
    )
    parser.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        default=None,
        help="the replay socket (ROUTER) of the KV events, e.g. tcp://127.0.0.1:5558 (needs --kv-events)",
    )
    _add_vllm_identity(parser)
    faults = parser.add_argument_group(
        "fault injection", "as POST /admin/fault on each engine; see loadtests/sim/faults.py"
    )
    faults.add_argument("--fault", choices=[m.value for m in FaultMode], default="none", help="the fault to inject")
    faults.add_argument("--fault-after-tokens", type=int, default=0, metavar="N", help="stall or close after N tokens")
    faults.add_argument(
        "--fault-engine",
        type=int,
        action="append",
        metavar="I",
        help="inject only into engine I (0 = the first port; repeatable; default: every engine)",
    )
    parser.set_defaults(func=run)


def _add_vllm_identity(parser: argparse.ArgumentParser) -> None:
    vllm = parser.add_argument_group(
        "vLLM's token ids and block hashes",
        "with --tokenizer each engine tokenizes prompts and hashes its KV blocks exactly as vLLM does (its KV "
        "events then carry vLLM's hashes); without it, the simulator's own word tokenizer and hash chain",
    )
    vllm.add_argument("--tokenizer", metavar="PATH", default=None, help="the model's tokenizer.json")
    vllm.add_argument(
        "--chat-template",
        metavar="PATH",
        default=None,
        help="the chat template: a .jinja file or a tokenizer_config.json (without it a chat request is "
        "refused 400, as vLLM refuses it for a model without one)",
    )
    vllm.add_argument(
        "--hash-algo",
        choices=[a.value for a in HashAlgorithm],
        default=None,
        help=f"vLLM's --prefix-caching-hash-algo (default {DEFAULT_HASH_ALGO.value}, vLLM's)",
    )
    vllm.add_argument(
        "--hash-seed",
        metavar="S",
        default=None,
        help="vLLM's PYTHONHASHSEED, the root of every block chain (default: this environment's PYTHONHASHSEED; "
        "unset: a random root per engine, as each vLLM process draws its own)",
    )
    vllm.add_argument(
        "--int-block-hashes",
        action="store_true",
        help="KV events carry each hash's low 64 bits as an int (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) "
        "instead of its bytes",
    )


def _vllm_identity(args: argparse.Namespace) -> tuple[HfTokenization | None, VllmHashingSpec | None]:
    """The tokenizer and block hashing ``--tokenizer`` and its companions ask for (None, None without it)."""
    if args.tokenizer is None:
        given = [flag for flag, value in _IDENTITY_FLAGS.items() if getattr(args, value) not in (None, False)]
        if given:
            raise SystemExit(f"{', '.join(given)} needs --tokenizer")
        return None, None
    try:
        tokenization = HfTokenization.from_files(args.tokenizer, args.chat_template)
    except Exception as exc:  # the Rust side's errors and ChatTemplateError alike
        raise SystemExit(f"--tokenizer/--chat-template: {exc}") from exc
    seed = args.hash_seed if args.hash_seed is not None else os.environ.get("PYTHONHASHSEED")
    spec = VllmHashingSpec(args.hash_algo or DEFAULT_HASH_ALGO.value, seed, args.int_block_hashes)
    return tokenization, spec


_IDENTITY_FLAGS = {
    "--chat-template": "chat_template",
    "--hash-algo": "hash_algo",
    "--hash-seed": "hash_seed",
    "--int-block-hashes": "int_block_hashes",
}


def run(args: argparse.Namespace) -> int:
    if args.count < 1 or args.time_scale <= 0:
        raise SystemExit("--count must be >= 1 and --time-scale > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.ports is not None:
        args.count = len(args.ports)
    ports = args.ports or [args.port + i for i in range(args.count)]
    if not args.prompt_tokens_details and args.answer_format != AnswerFormat.VLLM.value:
        raise SystemExit("--no-prompt-tokens-details is vLLM's switch; llama.cpp always reports cached_tokens")
    if args.kv_events_replay is not None and args.kv_events is None:
        raise SystemExit("--kv-events-replay needs --kv-events")
    faults = _faults(args)
    tokenization, block_hashing = _vllm_identity(args)
    main = serve_engines(
        args.profile,
        host=args.host,
        ports=ports,
        model=args.model,
        time_scale=args.time_scale,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        faults=faults,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cache_scope=args.cache_scope,
        max_num_seqs=args.max_num_seqs,
        answer_format=args.answer_format,
        prompt_tokens_details=args.prompt_tokens_details,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        tokenization=tokenization,
        block_hashing=block_hashing,
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, contextlib.suppress(KeyboardInterrupt):
        runner.run(main)
    return 0


def _faults(args: argparse.Namespace) -> dict[int, Fault]:
    if args.fault_after_tokens < 0:
        raise SystemExit("--fault-after-tokens must be >= 0")
    indices = args.fault_engine if args.fault_engine is not None else range(args.count)
    if any(not 0 <= i < args.count for i in indices):
        raise SystemExit(f"--fault-engine must be between 0 and {args.count - 1}")
    fault = Fault(FaultMode(args.fault), args.fault_after_tokens)
    if fault.needs_engine and get_profile(args.profile).kind is ProfileKind.INSTANT:
        raise SystemExit(f"--fault {fault.mode.value} needs an engine; the {args.profile} profile has none")
    return {} if fault.mode is FaultMode.NONE else dict.fromkeys(indices, fault)


def _ports(text: str) -> list[int]:
    try:
        ports = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ports: {text!r}") from None
    if not ports or any(not 0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be between 1 and 65535: {text!r}")
    return ports
