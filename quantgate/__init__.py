"""quantgate's Python API: the three jobs of the commands, for a pipeline of your own.

Each function is the one its command runs (``quantize``, ``gate checkpoint``, ``evals run``,
``gate accuracy``); it returns a typed result instead of printing, and raises instead of exiting:
every error a user can cause (``PlanError``, ``CheckpointError``, ``BadInput``, ...) is a
``quant.errors.QuantgateError`` that names the file or tensor and the fix and carries the exit code
the command would return (2 bad input or refused, 1 a conversion that failed (disk full), 3 a run
that could not finish). Nothing here calls ``sys.exit``.

    import quantgate
    plan = quantgate.plan("/ckpt/GLM-5-bf16")                      # headers only; plan.summary()
    done = quantgate.convert(plan, "/ckpt/GLM-5-mxfp4")            # Conversion: manifest, sizes, seconds
    report = quantgate.check("/ckpt/GLM-5-mxfp4")                  # report.ok, report.findings
    run = quantgate.evaluate("runs/mxfp4", "glm-5-mxfp4", ["gsm8k"], base_url="http://127.0.0.1:30000")
    verdict = quantgate.gate("runs/mxfp4", "runs/fp8")             # verdict.passed, verdict.blocking

Heavy libraries load only inside the function that needs them (torch and numba for conversion,
lm-eval for evaluation), as in the commands.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quant.plan import Plan
    from quant.verify import Report

__all__ = ["Conversion", "Evaluation", "Verdict", "check", "convert", "evaluate", "gate", "plan"]


@dataclass(frozen=True)
class Conversion:
    """A finished conversion: the output folder and its ``conversion_manifest.json``."""

    output: Path
    manifest: dict

    @property
    def seconds(self) -> float:
        return self.manifest["seconds"]

    @property
    def bytes_in(self) -> int:
        return self.manifest["summary"]["bytes_in"]

    @property
    def bytes_out(self) -> int:
        return self.manifest["summary"]["bytes_out"]


@dataclass(frozen=True)
class Evaluation:
    """A finished run bundle: its folder, each benchmark's score (n, 95% interval) and run.json."""

    out: Path
    scores: dict[str, dict]
    run: dict


@dataclass(frozen=True)
class Verdict:
    """The accuracy gate's decision; ``result`` is what ``gate accuracy --json`` prints."""

    verdict: str  # PASS, FAIL or INCONCLUSIVE
    blocking: list[str]
    benchmarks: list[dict]
    result: dict

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def exit_code(self) -> int:
        """What ``gate accuracy`` returns for it: 0 pass, 1 fail or a blocking INCONCLUSIVE."""
        return 0 if self.passed else 1


def plan(source: str | Path, to: str = "mxfp4", *, recipe: str | Path | None = None, serve: tuple[str, ...] = (),
         **overrides: Any) -> Plan:
    """What ``quantize --dry-run`` prints, from headers alone. ``to="bf16"`` plans an exact decode;
    ``serve``: the releases the output is for (``("sglang==0.5.23",)``, as ``--serve``), refused where one
    would not load it; ``overrides`` are the recipe's policy flags: ``shared_experts``, ``mtp_experts``,
    ``weight_only``, ``scale_rule``."""
    from quant.decode_plan import make_decode_plan
    from quant.plan import PlanError, make_plan
    from quant.recipe import load_recipe, with_overrides
    from quant.release_check import parse_serve

    served = tuple(dict.fromkeys(parse_serve(spec) for spec in serve))
    if to == "bf16":
        if served:
            raise PlanError("serve checks a quantized output; to='bf16' decodes to plain bf16, which every release "
                            "loads")
        return make_decode_plan(Path(source))
    return make_plan(Path(source), with_overrides(load_recipe(Path(recipe) if recipe else None, to), **overrides),
                     serve=served)


def convert(planned: Plan, output: str | Path, *, overwrite: bool = False, resume: bool = False,
            workers: int | None = None, progress: bool = False) -> Conversion:
    """Run a plan into ``output`` (an empty folder, or ``resume`` an interrupted one); atomic and
    locked as in ``quantize``."""
    from quant.convert import convert as run_plan
    from quant.outputs import check_destination

    output = Path(output)
    check_destination(planned.source_dir, output, overwrite, resume)
    manifest = run_plan(planned, output, overwrite=overwrite, resume=resume, workers=workers, show_progress=progress)
    return Conversion(output, manifest)


def check(checkpoint: str | Path, engine: str = "all", *, deep: bool = False, **serving: Any) -> Report:
    """``gate checkpoint``: whether each engine release loads the checkpoint correctly. ``serving``
    is the setup sglang is started with: ``gpu`` (a GPU model), ``platform``, ``gpu_arch``, ``tp``, ``pp``,
    ``ep``, ``disable_shared_experts_fusion``, ``speculative`` (default: MI355X, TP 8, with the MTP draft).
    ``report.ok`` is the exit code's answer; ``report.verdict`` names the failing and unread releases."""
    from quant.engines.serving import serving as setup
    from quant.verify import verify

    return verify(Path(checkpoint), engine, deep, setup(**serving))


def evaluate(out: str | Path, model: str | Path, benchmarks: list[str], **options: Any) -> Evaluation:
    """``evals run``: benchmarks against a server (``base_url=``, ``model`` its served name) or a local
    checkpoint folder, into a run bundle at ``out``. ``options`` are ``evals.run.RunSpec``'s fields
    (``limit``, ``data_dir``, ``seeds``, ``max_gen_toks``, ``tokenizer``, ...)."""
    from evals.run import RunSpec, run

    result = run(RunSpec(benchmarks=list(benchmarks), out=Path(out), model=str(model), **options))
    return Evaluation(Path(out), result["scores"], result)


def gate(candidate: str | Path, reference: str | Path, *, policy: str | Path | None = None,
         margins: dict[str, float] | None = None, benchmarks: list[str] | None = None) -> Verdict:
    """``gate accuracy``: the paired comparison of two run bundles under the release policy."""
    from evals.judge.gate import accuracy_gate
    from evals.judge.policy import load_policy

    rules = load_policy(policy or None).with_margins(margins or {})  # a str may be a shipped name; a Path is a path
    result = accuracy_gate(Path(candidate), Path(reference), rules, benchmarks=benchmarks)
    return Verdict(result["verdict"], list(result["blocking"]), list(result["benchmarks"]), result)
