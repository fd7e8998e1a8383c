"""Two tau2 arms end to end: real ``tau2 run`` on airline, retail and telecom against the scripted
server (tests/evals/scripted_server.py), then ``gate accuracy`` on the two bundles.

    python -m tests.benchmarks.tau2_arms OUT [--tasks 4] [--concurrency 4]

The reference model ("ref") solves every task the way tau2's own evaluation criteria say; the
candidate ("cand") leaves one task per domain unsolved (airline, retail: it says it is done
without acting; telecom: invalid tool arguments until tau2 stops it) and misbehaves on purpose: an
unparsable tool call (airline), a context overflow (retail) and a dropped connection (telecom).
Every simulation still ends as a row; the candidate's bundle counts one infrastructure error, so
the gate calls tau2 INCONCLUSIVE; then the connection is fixed, ``evals run --resume`` runs that
simulation again, and the gate judges the candidate on the macro.
Not a test: the demonstration for the closing note (prints each command and the gate's table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from quant.layout import manifests_root

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
EVALS = [sys.executable, "-c", "import sys; from evals.cli import evals_main; sys.exit(evals_main(sys.argv[1:]))"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tasks", type=int, default=4, help="tasks per domain")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()

    from tau2.run import get_tasks

    from tests.evals.scripted_server import script_for, serve

    tasks = {d: get_tasks(d, "base", num_tasks=args.tasks) for d in ("airline", "retail", "telecom")}
    tag = lambda d, i: f"{d}/{tasks[d][i].id}"  # noqa: E731
    cand = {tag("airline", 1): "malformed", tag("airline", 2): "wrong", tag("retail", 0): "wrong",
            tag("retail", 1): "overflow", tag("telecom", 0): "toolerror", tag("telecom", 1): "drop"}
    server, script = serve(script_for(tasks, {"ref": {}, "cand": cand}))
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"

    def evals_run(arm: str, *extra: str) -> None:
        cmd = [*EVALS, "run", "--benchmarks", "tau2", "--out", str(args.out / arm), "--model", arm,
               "--base-url", f"{base}/chat/completions", "--limit", str(args.tasks), "--tau2-user-llm", "openai/user",
               "--tau2-user-llm-args", json.dumps({"api_base": base}), "--tau2-max-steps", "30",
               "--tau2-max-retries", "0", "--tau2-concurrency", str(args.concurrency), *extra]
        print("$ evals", " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True)
        summary = json.loads((args.out / arm / "run.json").read_text())["benchmarks"]["tau2"]
        print(json.dumps({k: summary[k] for k in ("macro_pass1", "simulations", "infra_errors", "infra_error_rate")}
                         | {d: {k: v[k] for k in ("pass1", "tasks", "infra_errors", "model_errors", "errors")}
                            for d, v in summary["domains"].items()}, indent=1), flush=True)

    def gate(*extra: str) -> None:
        cmd = [sys.executable, "-m", "evals.cli", "accuracy", "--candidate", str(args.out / "cand"),
               "--reference", str(args.out / "ref"), *extra]
        print("$ gate", " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd)

    evals_run("ref")
    evals_run("cand")
    gate()
    print("# the connection is fixed; --resume runs the infrastructure error again", flush=True)
    script.modes["cand"][tag("telecom", 1)] = "solve"
    evals_run("cand", "--resume")
    gate()
    print(f"# the same with the policy's tau2 min_items lowered to {3 * args.tasks} (a demonstration, not a release)")
    policy = yaml.safe_load((manifests_root() / "gates" / "release.yaml").read_text())
    policy["benchmarks"]["tau2"]["min_items"] = 3 * args.tasks
    (args.out / "policy.yaml").write_text(yaml.safe_dump(policy))
    gate("--policy", str(args.out / "policy.yaml"))
    server.shutdown()

if __name__ == "__main__":
    main()
