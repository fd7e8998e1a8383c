"""The judging side of evals: paired statistics, the gate policy and designs, verdicts and their renderings
(CLI table, report.md/.json, the release page, the dashboard). Running evaluations lives beside it in evals/."""
