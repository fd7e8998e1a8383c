"""``evals load``: a serving-load sweep on guidellm, one constant request rate at a time, into a load bundle.

The load generator is guidellm 0.8.1 (the ``load`` extra), driven through its own CLI,
``python -m guidellm run --scenario FILE`` (guidellm/cli/run.py, ``run``): the scenario file is a
``BenchmarkScenario`` (guidellm/schemas/benchmark/entrypoints.py, ``BenchmarkScenario.create``
reads a JSON file whose ``spec`` holds ``BenchmarkArgs`` fields). Each rate is one guidellm run:
the results of finished rates are on disk whatever happens to the next one, a dead server is
noticed between rates, Ctrl-C or SIGTERM keep what was measured, and the sweep stops once a rate
breaks the TTFT SLO (the knee is then bracketed; higher rates would only queue).

The workload (seed: 20000 prompt tokens, 1000 output tokens, 60% prefix-cache hits) is
guidellm's ``synthetic_text`` data (guidellm/data/deserializers/synthetic.py): every prompt is one
shared prefix of ``prefix_hit x prompt_tokens`` tokens (``prefix_tokens``, ``prefix_count=1``),
then unique text for the rest, so a server with a prefix cache hits that share of each prompt's
tokens after the first request. For ``/v1/completions`` guidellm sends ``prefix + " " + text``
(guidellm/backends/openai/request_handlers.py, ``TextCompletionsRequestHandler.format``); with
``output_tokens`` set it also sends ``ignore_eos: true`` so every answer has exactly that many
tokens (vLLM and sglang accept it; ``transformers serve`` rejects the field with HTTP 422:
``--no-ignore-eos`` then sends only ``max_tokens``, which caps rather than fixes the length).

Per rate the bundle keeps guidellm's own report (per-request timings; prompt and output text
dropped, they are synthetic and large) and a summary row taken from guidellm's metrics
(guidellm/benchmark/schemas/metrics.py, ``GenerativeMetrics``): achieved RPS = successful requests
per second, output tok/s = tokens streamed per second over all requests, TTFT and inter-token
latency percentiles over successful requests, and the success fraction = successful /
(successful + errored); requests still running when the time limit cut the rate are counted as
``incomplete``, not as failures.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from evals.bundle import BundleError
from evals.errors import BadInput, RunFailed
from evals.probe import get_json
from quant.outputs import write_atomic
from quant.safe_files import create_new, make_folder, read_json

LOAD_JSON = "load.json"
FORMAT = "quantgate-load/1"
GUIDELLM = "guidellm"
DEFAULT_RATES = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
_PROGRESS = re.compile(r"successful=(\d+) errored=(\d+) incomplete=(\d+)")


class LoadError(RunFailed):
    """The sweep could not start or measure anything (the CLI's exit 3)."""


@dataclass
class Workload:
    prompt_tokens: int = 20000
    output_tokens: int = 1000
    prefix_hit: float = 0.6
    ignore_eos: bool = True
    api: str = "completions"
    seed: int = 42

    def __post_init__(self):
        if self.prompt_tokens < 2 or self.output_tokens < 1:
            raise BadInput("--prompt-tokens must be >= 2 and --output-tokens >= 1")
        if not 0.0 <= self.prefix_hit < 1.0:
            raise BadInput(f"--prefix-hit {self.prefix_hit}: expected a fraction in [0, 1)")

    @property
    def prefix_tokens(self) -> int:
        return round(self.prompt_tokens * self.prefix_hit)

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_tokens": self.prefix_tokens,
                "unique_tokens": self.prompt_tokens - self.prefix_tokens}


@dataclass
class LoadSpec:
    base_url: str
    model: str
    tokenizer: str
    out: Path
    workload: Workload = field(default_factory=Workload)
    rates: list[float] = field(default_factory=lambda: list(DEFAULT_RATES))
    max_seconds: float = 300.0
    max_requests: int | None = None  # also stop a rate after this many requests (all of them finish)
    ttft_slo_s: float = 5.0
    stop_at_knee: bool = True
    refine_step: float = 0.1  # bisect the bracketing rates until they are this close (req/s)


def server_root(url: str) -> str:
    """``http://host:port`` from any of the URL forms users paste (root, /v1, or a full endpoint)."""
    url = url.rstrip("/")
    for suffix in ("/v1/chat/completions", "/v1/completions", "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def served_models(root: str, timeout: float = 10.0) -> list[str]:
    """Model ids the server reports at ``GET /v1/models``; raises LoadError when it does not answer."""
    try:
        return [m["id"] for m in get_json(f"{root}/v1/models", timeout)["data"]]  # bounded: evals.probe
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"{root}/v1/models did not answer ({exc}); is the server up?") from None


def scenario(spec: LoadSpec, rate: float, report: Path) -> dict:
    """The guidellm scenario for one constant rate (also the bundle's record of what was run)."""
    w = spec.workload
    data = {"kind": "synthetic_text", "prompt_tokens": w.prompt_tokens - w.prefix_tokens}
    if w.prefix_tokens:
        data |= {"prefix_tokens": w.prefix_tokens, "prefix_count": 1}
    backend = {"kind": "openai_http", "target": server_root(spec.base_url), "model": spec.model,
               "request_format": "/v1/completions" if w.api == "completions" else "/v1/chat/completions"}
    if w.ignore_eos:
        data["output_tokens"] = w.output_tokens  # guidellm then sends max_tokens + ignore_eos
    else:
        backend["max_tokens"] = w.output_tokens
    # max_duration cancels requests still running at the limit; max_requests stops sending after N
    # and waits for them (guidellm/scheduler/constraints/request.py, MaxNumberConstraint.__call__);
    # max_error_rate ends a rate against a dead server instead of erroring for max_seconds
    constraints = [{"kind": "max_duration", "seconds": spec.max_seconds},
                   {"kind": "max_error_rate", "rate": 0.5, "window": 10}]
    if spec.max_requests:
        constraints.append({"kind": "max_requests", "count": spec.max_requests})
    return {"metadata": {"labels": {"tool": "quantgate evals load", "rate": str(rate)}},
            "spec": {"backend": backend,
                     "profile": {"kind": "constant", "rate": [rate]},
                     "constraints": constraints,
                     "tokenizer": {"kind": "huggingface_auto", "model": str(spec.tokenizer)},
                     "data": [data],
                     "seed": {"kind": "static", "value": w.seed},
                     "outputs": [{"kind": "json", "path": str(report)}]}}


def _first_line(text: str | None) -> str:
    return (text or "unknown error").strip().splitlines()[0][:300]


def summarize(report: dict, rate: float) -> dict:
    """One sweep row from guidellm's report of one constant-rate benchmark."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    ok = lambda name, stat: m[name]["successful"]["percentiles"][stat] if totals["successful"] else None  # noqa: E731
    errors: dict[str, int] = {}
    for r in bench["requests"]["errored"]:
        msg = _first_line(r["info"].get("error"))
        errors[msg] = errors.get(msg, 0) + 1
    finished = totals["successful"] + totals["errored"]
    ttft = [ok("time_to_first_token_ms", p) for p in ("p50", "p95")]
    # each successful request's TTFT (guidellm keeps every request's timings in the report whatever its
    # sample_size: guidellm/benchmark/schemas/accumulator.py), for the knee's bootstrap over requests
    ttft_s = [r["time_to_first_token_ms"] / 1000 for r in bench["requests"]["successful"]
              if r.get("time_to_first_token_ms") is not None]
    return {"rate": rate,
            "achieved_rps": m["requests_per_second"]["successful"]["mean"],
            "output_tok_s": m["output_tokens_per_second"]["total"]["mean"],
            "ttft_p50_s": None if ttft[0] is None else ttft[0] / 1000,
            "ttft_p95_s": None if ttft[1] is None else ttft[1] / 1000, "ttft_s": ttft_s,
            "itl_p50_ms": ok("inter_token_latency_ms", "p50"), "itl_p95_ms": ok("inter_token_latency_ms", "p95"),
            "prompt_tokens_mean": m["prompt_token_count"]["successful"]["mean"] if totals["successful"] else None,
            "output_tokens_mean": m["output_token_count"]["successful"]["mean"] if totals["successful"] else None,
            "successful": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "success_fraction": totals["successful"] / finished if finished else None,
            "errors": errors, "duration_s": bench["duration"],
            "guidellm_warnings": [w.get("message", "") for w in bench.get("warnings", [])]}


def _strip_texts(report: dict) -> dict:
    """guidellm's report without prompts and answers (synthetic, and ~prompt_tokens each); still loadable."""
    for bench in report["benchmarks"]:
        for requests in bench["requests"].values():
            for r in requests if isinstance(requests, list) else []:
                r["request_args"] = r["output"] = r["reasoning_output"] = None
    return report


def _write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2))


def rate_folder(out: Path, rate: float) -> Path:
    return out / "rates" / f"rate-{rate:g}"


def _run_rate(spec: LoadSpec, rate: float, show_progress: bool) -> dict:
    """One guidellm run at a constant rate; returns its summary row (raises LoadError if it produced none)."""
    from tqdm import tqdm

    folder = make_folder(rate_folder(spec.out, rate))
    raw = folder / "guidellm-report.partial.json"
    raw.unlink(missing_ok=True)  # a stale report, or a link planted there: guidellm writes it anew
    _write_json(folder / "scenario.json", scenario(spec, rate, raw))
    log = folder / "guidellm.log"
    cmd = [sys.executable, "-m", GUIDELLM, "run", "--scenario", str(folder / "scenario.json"), "--disable-console"]
    limit = spec.max_seconds + 600  # startup (tokenizer, worker processes) and shutdown on a busy host
    started = time.monotonic()
    with os.fdopen(create_new(log), "w") as sink, tqdm(
            desc=f"{rate:g} req/s (up to {spec.max_seconds:g} s + startup)", unit="s",
            bar_format="{desc}: {elapsed} {postfix}", disable=None if show_progress else True, leave=False) as bar:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if time.monotonic() - started > limit:
                    proc.kill()
                    break
                counts = _PROGRESS.findall(log.read_text(errors="replace")[-4000:])
                if counts:
                    s, e, i = counts[-1]
                    bar.set_postfix_str(f"ok={s} err={e} running={i}")
                bar.refresh()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    if not raw.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise LoadError(f"guidellm wrote no report at {rate:g} req/s (exit {proc.returncode}); "
                        f"log {log}: {' | '.join(tail)}")
    report = _strip_texts(json.loads(raw.read_text()))
    _write_json(folder / "guidellm-report.json", report)
    raw.unlink()
    row = summarize(report, rate)
    row |= {"wall_s": round(time.monotonic() - started, 1), "report": str((folder / "guidellm-report.json")
                                                                          .relative_to(spec.out))}
    return row


def slo_breach(row: dict, ttft_slo_s: float, min_success: float) -> str | None:
    """Why a rate is outside the SLO (None when within it: requests succeeded, TTFT p95 <= SLO, few failed)."""
    if not row["successful"]:
        return "no request succeeded"
    if row["success_fraction"] < min_success:
        return f"success {row['success_fraction']:.1%} < {min_success:.0%}"
    if row["ttft_p95_s"] > ttft_slo_s:
        return f"TTFT p95 {row['ttft_p95_s']:.2f} s > {ttft_slo_s:g} s"
    return None


def next_rate(spec: LoadSpec, rows: list[dict], min_success: float) -> float | None:
    """The rate to measure next, None when the sweep is done. First the grid upwards (all of it with
    ``stop_at_knee`` off, else until a rate breaks the SLO); then bisection between the highest rate that
    met the SLO and the next one above it, which broke it, until they are ``refine_step`` apart."""
    done = {r["rate"] for r in rows}
    broken = {r["rate"] for r in rows if slo_breach(r, spec.ttft_slo_s, min_success)}
    for rate in sorted(spec.rates):
        if rate not in done and not (spec.stop_at_knee and broken):
            return rate
    met = done - broken
    if not met:
        return None
    top = max(met)
    above = [b for b in broken if b > top]
    if not above or min(above) - top <= spec.refine_step * (1 + 1e-9):
        return None
    mid = round((top + min(above)) / 2, 4)
    return None if mid in done else mid


def _check_served(spec: LoadSpec) -> tuple[str, list[str]]:
    root = server_root(spec.base_url)
    reported = served_models(root)
    if spec.model not in reported:
        raise BadInput(f"--model {spec.model!r} is not served at {root}; the server reports {reported}")
    return root, reported


def _holds_bundle(out: Path) -> bool:
    return (out / LOAD_JSON).exists() or bool(sweep_folders(out))


def run_load(spec: LoadSpec, show_progress: bool = True, min_success: float = 0.99) -> dict:
    """The sweep. Returns the bundle (also in ``out/load.json``); raises LoadError when nothing was measured."""
    try:
        version = metadata.version(GUIDELLM)
    except metadata.PackageNotFoundError:
        raise LoadError("guidellm is not installed: pip install 'quantgate[load]'") from None
    if _holds_bundle(spec.out):
        raise BadInput(f"{spec.out} already holds a load bundle; choose a new --out")
    root, reported = _check_served(spec)
    spec.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    bundle = {"format": FORMAT, "state": "running", "tool": {"name": GUIDELLM, "version": version},
              "server": {"base_url": root, "model": spec.model, "reported_models": reported},
              "tokenizer": str(spec.tokenizer), "workload": spec.workload.to_dict(), "ttft_slo_s": spec.ttft_slo_s,
              "min_success": min_success, "max_seconds": spec.max_seconds,
              "max_requests": spec.max_requests, "planned_rates": spec.rates, "refine_step": spec.refine_step,
              "rates": [], "stopped": None, "timings": {"started": started.isoformat()}}
    _write_json(spec.out / LOAD_JSON, bundle)
    if show_progress:
        print(f"sweeping {root}: one guidellm run per rate, logs under {spec.out / 'rates'}\n{TABLE_HEAD}",
              file=sys.stderr)
    try:
        while (rate := next_rate(spec, bundle["rates"], min_success)) is not None:
            if bundle["rates"]:
                served_models(root)  # a dead server ends the sweep here, with what was measured
            row = _run_rate(spec, rate, show_progress)
            if not row["successful"]:  # a dead server is not the knee: check before counting the rate
                try:
                    served_models(root)
                except LoadError as exc:
                    raise LoadError(f"{exc}; it went during {rate:g} req/s, not counted (guidellm's report: "
                                    f"{row['report']})") from None
            bundle["rates"].append(row)
            _write_json(spec.out / LOAD_JSON, bundle)
            if show_progress:
                print(format_row(row), file=sys.stderr)
        bundle["stopped"] = _bracket(bundle["rates"], spec, min_success)
    except (LoadError, KeyboardInterrupt) as exc:
        bundle["stopped"] = str(exc) or "interrupted"
    finished = datetime.now(timezone.utc)
    bundle["timings"] |= {"finished": finished.isoformat(), "wall_s": round((finished - started).total_seconds(), 1)}
    bundle["state"] = "done"  # the sweep ended (``stopped`` says why, when early); the file is final
    _write_json(spec.out / LOAD_JSON, bundle)
    if not any(r["successful"] for r in bundle["rates"]):
        raise LoadError(f"nothing measured ({bundle['stopped'] or 'no request succeeded'}); "
                        f"see {spec.out / LOAD_JSON}")
    return bundle


def _bracket(rows: list[dict], spec: LoadSpec, min_success: float) -> str | None:
    """Where the finished sweep puts the knee, when it stopped short of the grid's top (None: it ran it all)."""
    broken = sorted(r["rate"] for r in rows if slo_breach(r, spec.ttft_slo_s, min_success))
    met = sorted(r["rate"] for r in rows if r["rate"] not in broken)
    if not broken:
        return None
    if not met:
        return f"{broken[0]:g} req/s broke the SLO and no lower rate met it: add lower --rates"
    above = [b for b in broken if b > met[-1]]
    if not above:
        return None
    return (f"{above[0]:g} req/s broke the SLO; the knee lies between {met[-1]:g} and {above[0]:g} req/s "
            f"(refined to {spec.refine_step:g} req/s)")


def sweep_folders(out: Path) -> list[Path]:
    """``out/sweep-1``, ``out/sweep-2``, ...: the repeated sweeps of one server, in the order they ran."""
    found = [p for p in Path(out).glob("sweep-*") if p.is_dir() and p.name[6:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[6:]))


def run_repeats(specs: dict[str, LoadSpec], repeats: int, show_progress: bool = True,
                min_success: float = 0.99) -> dict[str, list[dict]]:
    """``repeats`` sweeps of each server into ``out/sweep-K``, interleaved (sweep 1 of every server, then
    sweep 2, ...: A B A B), so drift on the host hits both arms alike. Servers and folders are checked
    before the first request; an interrupted sweep ends the run with what was measured."""
    outs = [spec.out.resolve() for spec in specs.values()]
    if len(set(outs)) < len(outs):
        raise BadInput("the candidate and reference sweeps need different --out folders")
    for spec in specs.values():
        if _holds_bundle(spec.out):
            raise BadInput(f"{spec.out} already holds a load bundle; choose a new --out")
        _check_served(spec)
    done: dict[str, list[dict]] = {name: [] for name in specs}
    for k in range(1, repeats + 1):
        for name, spec in specs.items():
            if show_progress:
                print(f"{name}: sweep {k} of {repeats} -> {spec.out / f'sweep-{k}'}", file=sys.stderr)
            bundle = run_load(replace(spec, out=spec.out / f"sweep-{k}"), show_progress, min_success)
            done[name].append(bundle)
            if bundle["stopped"] == "interrupted":
                return done
    return done


def read_sweeps(folder: Path) -> list[tuple[Path, dict]]:
    """The sweeps of one server: ``folder/sweep-K/load.json`` (``evals load --repeats``), or a single sweep's
    ``folder/load.json``; each validated by ``read_load_bundle``."""
    folder = Path(folder)
    if (folder / LOAD_JSON).exists():
        return [(folder, read_load_bundle(folder))]
    subs = sweep_folders(folder)
    if not subs:
        raise BundleError(f"{folder}: not a load bundle (no {LOAD_JSON} and no sweep-*/{LOAD_JSON}; made by "
                          "`evals load`)")
    return [(p, read_load_bundle(p)) for p in subs]


def read_load_bundle(folder: Path) -> dict:
    """``load.json`` of a finished sweep, validated: every key the gate reads, of its type, and
    every rate a finite number in its range (a NaN success fraction would pass any SLO)."""
    path = Path(folder) / LOAD_JSON
    try:
        bundle = read_json(path, BundleError, "a load bundle is written by `evals load`")
    except FileNotFoundError:
        raise BundleError(f"{folder}: not a load bundle ({LOAD_JSON} missing; made by `evals load`)") from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot be read ({exc.strerror}); check the file and its permissions") from None
    if not isinstance(bundle, dict):
        raise BundleError(f"{path}: a JSON {type(bundle).__name__}, not a load bundle; give the folder `evals load` "
                          "wrote")
    if bundle.get("format") != FORMAT:
        raise BundleError(f"{path}: format {str(bundle.get('format'))[:40]!r}, expected {FORMAT!r}")
    if bundle.get("state") != "done":
        raise BundleError(f"{path}: the sweep did not finish (still running, or killed)")
    _check_load_bundle(path, bundle)
    return bundle


def _is_number(x, low: float = 0.0, high: float = math.inf) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high


def _check_load_bundle(path: Path, bundle: dict) -> None:
    def need(ok: bool, where: str, value, what: str) -> None:
        if not ok:
            raise BundleError(f"{path}: {where} is {str(value)[:40]!r}, not {what}; rerun `evals load`")

    workload, rates = bundle.get("workload"), bundle.get("rates")
    need(isinstance(workload, dict) and all(k in workload for k in Workload.__dataclass_fields__), "workload",
         workload, f"an object with {', '.join(Workload.__dataclass_fields__)}")
    need(isinstance(bundle.get("tool"), dict), "tool", bundle.get("tool"), "an object")
    need(_is_number(bundle.get("ttft_slo_s")) and bundle["ttft_slo_s"] > 0, "ttft_slo_s", bundle.get("ttft_slo_s"),
         "a positive number of seconds")
    if "min_success" in bundle:
        need(_is_number(bundle["min_success"], 0, 1), "min_success", bundle["min_success"], "a fraction in 0..1")
    need(isinstance(rates, list), "rates", rates, "a list")
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    # Types here; a measured rate's NaN, Inf or negative numbers are refused by the gate naming the
    # rate (knee.check_rows), where a rate with no success may carry none.
    rules = {"successful": ("a count", count), "errored": ("a count", count),
             "rate": ("a positive number of requests per second", lambda x: _is_number(x) and x > 0),
             "achieved_rps": ("a number", lambda x: x is None or number(x)),
             "output_tok_s": ("a number", lambda x: x is None or number(x)),
             "ttft_p95_s": ("a number", lambda x: x is None or number(x)),
             "success_fraction": ("a fraction in 0..1",
                                  lambda x: x is None or (number(x) and (not math.isfinite(x) or 0 <= x <= 1)))}
    for n, row in enumerate(rates):
        need(isinstance(row, dict), f"rates[{n}]", row, "an object")
        missing = [k for k in rules if k not in row]
        if missing:
            raise BundleError(f"{path}: rates[{n}] lacks {missing}; rerun `evals load`")
        for key, (what, ok) in rules.items():
            need(ok(row[key]), f"rates[{n}].{key}", row[key], what)


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


TABLE_HEAD = (f"{'rate':>6} {'achieved':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'out tok/s':>10} "
              f"{'ok':>5} {'err':>4} {'cut':>4} {'success':>8}")


def format_row(row: dict) -> str:
    return (f"{row['rate']:>6g} {_num(row['achieved_rps'], '9.3f')} {_num(row['ttft_p50_s'], '8.3f')}s "
            f"{_num(row['ttft_p95_s'], '8.3f')}s {_num(row['itl_p50_ms'], '6.1f')}ms {_num(row['output_tok_s'], '10.1f')} "
            f"{row['successful']:>5} {row['errored']:>4} {row['incomplete']:>4} {_num(row['success_fraction'], '8.1%')}")


def human(bundle: dict) -> str:
    w = bundle["workload"]
    lines = [f"{bundle['server']['model']} at {bundle['server']['base_url']} ({bundle['tool']['name']} "
             f"{bundle['tool']['version']}): {w['prompt_tokens']} prompt tokens ({w['prefix_tokens']} shared prefix), "
             f"{w['output_tokens']} output tokens{'' if w['ignore_eos'] else ' (max)'}, {bundle['max_seconds']:g} s per rate",
             TABLE_HEAD, *map(format_row, bundle["rates"])]
    for row in bundle["rates"]:
        for msg, count in row["errors"].items():
            lines.append(f"  {row['rate']:g} req/s: {count} x {msg}")
    lines.append("rate: offered req/s; achieved: successful req/s; cut: still running at the time limit; "
                 f"success: ok / (ok + err); SLO: TTFT p95 <= {bundle['ttft_slo_s']:g} s")
    if bundle["stopped"]:
        lines.append(f"stopped: {bundle['stopped']}")
    return "\n".join(lines)
