"""launch/bench_confidence.py's prompt-level scores read a prompt's own text: the chat template every prompt shares
(the system turn before, the generation prompt after) is left out."""

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_confidence.py"


def test_the_template_every_prompt_shares_is_left_out_of_its_own_text():
    ends = runpy.run_path(str(SCRIPT))["_template_ends"]  # not run as __main__: nothing loads
    system, header = [1, 2, 3], [8, 9]
    prompts = [system + [5, 6, 9] + header, system + [7] + header, system + [3, 3, 4, 9] + header]
    assert ends(prompts) == (3, 2)  # [3] and [9] begin / end some prompts' text, not every one's
    # one prompt, or prompts identical: every token is template, and the ends never overlap
    assert ends([system + header]) == (5, 0)
    assert ends([[1, 2], [1, 2, 2]]) == (2, 0)
