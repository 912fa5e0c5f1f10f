"""A small calibration and held-out text set shipped with qerl (``--calib qerl-text``), offline.

Two kinds of rows, each ``{"text": ...}``: short paragraphs of plain English prose written for qerl
(general knowledge, no copyrighted source), and worked word problems from ``synthetic-wordproblems``
(question and a short solution), i.e. the domain the ``smollm2_wordproblems`` recipe trains on. Real
text, not random tokens, so AWQ's activation statistics and the perplexity comparison mean something;
small, so AWQ runs on a CPU in minutes.
"""

from __future__ import annotations

from typing import Any

from qerl_cli.data.synthetic import make_problems

BUILTIN_NAME = "qerl-text"
# A calibration this set supports and a CPU runs in minutes: `qerl compare`'s AWQ bases and
# `qerl bench quality` both use it.
SMALL_CALIB_SAMPLES = 48
SMALL_CALIB_SEQ_LEN = 256
PARAGRAPHS = (
    "Rivers shape the land they cross. Over thousands of years a river cuts a valley, carries sand and "
    "silt downstream and drops it where the water slows, building plains and deltas where towns grow.",
    "A library is more than a room full of books. It keeps records of what people knew and believed, "
    "lends them to anyone who asks, and helps readers find the one page they need among millions.",
    "Bread needs only flour, water, salt and yeast. The yeast eats sugars in the dough and releases gas, "
    "which the stretchy gluten traps in small bubbles, so the loaf rises before it goes into the oven.",
    "The moon has no light of its own. We see sunlight reflected from its surface, and as it travels "
    "around the Earth each month we see more or less of its lit half, from a thin crescent to a full disc.",
    "When you save money in a bank, the bank pays you interest. If the interest is added to the balance "
    "each year, the next year's interest is paid on a larger amount, and savings grow faster over time.",
    "Bees visit flowers to collect nectar and pollen. As they move from plant to plant they carry pollen "
    "with them, which lets many fruits and vegetables form seeds. Farmers often rent hives for this work.",
    "A good map leaves things out. It shows the roads, rivers and towns a traveller needs and ignores the "
    "rest, and a small scale bar tells how many kilometres on the ground each centimetre stands for.",
    "Computers store numbers in binary, using only the digits zero and one. Eight binary digits make a "
    "byte, which can hold any whole number from zero to two hundred and fifty five.",
    "Glaciers are rivers of ice. Snow that does not melt in summer piles up, presses into ice under its "
    "own weight and slowly flows downhill, scraping the rock beneath and leaving long valleys behind.",
    "To add two numbers with two digits, add the ones first. If they make ten or more, write the ones "
    "digit and carry one to the tens. Then add the tens, including the carried one, to finish the sum.",
    "A healthy forest has trees of many ages. Old trees shade the ground, fallen logs feed fungi and "
    "insects, and young trees wait in the gaps for a storm to open the canopy and let the sunlight in.",
    "Trains changed how people measured time. Before railways each town kept its own local time, but "
    "timetables needed one clock for a whole region, so countries adopted standard time zones.",
    "Sound is a wave of pressure moving through air. Its pitch depends on how many waves pass each "
    "second, and its loudness on how strongly the air is squeezed, which is measured in decibels.",
    "Recipes are written for a number of servings. To cook for twice as many people you double every "
    "amount, but baking times change less, because heat reaches the middle of a dish at a similar speed.",
    "Ports connect ships to roads and railways. Cranes lift containers of a standard size from deck to "
    "truck in minutes, which is why goods made far away can reach a shop in a few weeks.",
    "Muscles grow stronger when they are used. Exercise causes small strains in the fibres, and during "
    "rest the body repairs them a little thicker than before, so regular training and sleep go together.",
    "A calendar year has three hundred and sixty five days, but the Earth takes about a quarter of a day "
    "longer to go around the Sun, so an extra day is added every fourth year to keep the seasons in place.",
    "Clean water is easy to take for granted. Cities filter river or lake water through sand, kill germs "
    "with chlorine or ultraviolet light, and test it every day before it reaches a kitchen tap.",
    "Chess is played on a board of sixty four squares. Each side starts with sixteen pieces, and the game "
    "ends when one king is attacked and cannot escape, which players call checkmate.",
    "Volcanoes form where melted rock rises from deep inside the Earth. Some erupt with explosions of ash, "
    "others with slow rivers of lava, and their ash makes some of the most fertile soils in the world.",
    "Writing a clear letter takes planning. Say first why you are writing, give the facts in order, and "
    "end with what you would like the reader to do, then read it once more before sending it.",
    "Most plants make their own food. Their leaves take in carbon dioxide from the air and water from the "
    "roots and, using the energy of sunlight, turn them into sugar, releasing oxygen as they do.",
    "A bicycle is very efficient. A rider on a flat road uses less energy per kilometre than a walker, "
    "because the wheels roll with little friction and the legs push in a smooth circle.",
    "Markets set prices through supply and demand. When a fruit is scarce and many people want it, the "
    "price rises; when the harvest is large, sellers lower prices to sell it before it spoils.",
)


def worked_problems(split: str, n: int) -> list[str]:
    """``n`` word problems of ``split`` with a one-line worked solution."""
    rows = []
    for p in make_problems("synthetic-wordproblems", split, n=n, seed=0):
        a, b = p.meta["a"], p.meta["b"]
        rows.append(f"Question: {p.question}\nAnswer: {a} + {b} = {p.answer}. The answer is {p.answer}.")
    return rows


def builtin_rows(problems: int = 48) -> list[dict[str, Any]]:
    """The shipped rows: every paragraph and ``problems`` worked training-split problems."""
    return [{"text": t} for t in (*PARAGRAPHS, *worked_problems("train", problems))]
