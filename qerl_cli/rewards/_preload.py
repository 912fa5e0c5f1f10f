"""Imported once by the grading forkserver so that every forked worker starts warm.

Importing math-verify pulls in SymPy and the LaTeX parser (about a second); one grade warms
their regex and parser caches. Workers forked afterwards share all of it copy-on-write.
"""

from qerl_cli.rewards.grading import grade

grade("<answer>\\frac{1}{2}</answer>", "0.5")
