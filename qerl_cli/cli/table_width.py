"""How wide a piped table must be printed for rich to cut none of its cells (see ``qerl_cli.cli.app``:
piped output has no terminal width, so the CLI's console widens each print to what its tables need)."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from rich.console import Console, ConsoleOptions, Group
from rich.measure import Measurement
from rich.table import Column, Table


def unbreakable_width(console: Console, renderables: list[Any]) -> int:
    """The width the tables among ``renderables`` (and other rich renderables) need to cut no cell and
    split no short one. The caller leaves messages out: they print with ``soft_wrap``, never wrapped."""
    # Measured without a ceiling: Measurement.get clamps the minimum to the options' width.
    options = console.options.update_width(_MEASURE_CEILING)
    return max((_least_width(console, options, obj) for obj in renderables), default=0)


def _least_width(console: Console, options: ConsoleOptions, renderable: Any) -> int:
    if isinstance(renderable, Group):  # a report of several tables (`qerl bench kernels`)
        return max((_least_width(console, options, part) for part in renderable.renderables), default=0)
    if isinstance(renderable, Table):
        return _table_width(console, options, renderable)
    return Measurement.get(console, options, renderable).minimum


def _table_width(console: Console, options: ConsoleOptions, table: Table) -> int:
    """The least width at which rich gives each column of ``table`` what :func:`_column_needs`. Not the
    table's minimum measure: rich shrinks the widest columns first, then all evenly, with no regard for
    their minimums, so a table of many columns had its names cut (``bf16-lo…``) at a width its minimum
    measure said was enough. The column widths are rich's own, at each width tried."""
    needs = [_column_needs(console, options, table, column) for column in table.columns]
    widest = Measurement.get(console, options, table).maximum  # nothing shrinks there

    def fits(width: int) -> bool:
        inner = options.update_width(max(1, width - table._extra_width))
        widths = table._calculate_column_widths(console, inner)
        return all(got >= need for got, need in zip(widths, needs, strict=True))

    if not fits(widest):  # a fixed-width column too narrow for its cells: the widest is the best there is
        return widest
    # rich's widths grow with the width it is given: the least width that fits, by bisection.
    return 1 + bisect_left(range(1, widest + 1), True, key=fits)


def _column_needs(console: Console, options: ConsoleOptions, table: Table, column: Column) -> int:
    """The width, padding included, below which rich would cut or split a cell of ``column``: its longest
    word, and the whole of each short cell (a number with its error, an interval, a name), which split
    over two lines reads as two values. A column that folds long words (prose, a command shown for
    reading) needs its header only; a fixed-width column is left as it was made."""
    if column.width is not None:
        return 0
    header = Measurement.get(console, options, column.header).minimum
    need = max(header, column.min_width or 0)
    if column.overflow != "fold" or column.no_wrap:
        for cell in column.cells:
            least, most = Measurement.get(console, options, cell)
            whole = column.no_wrap or most <= SHORT_CELL
            need = max(need, most if whole else least)
    return need + table._get_padding_width(column._index)


# A cell at most this wide is a value (a number, an interval, a name) and stays on one line; a longer one
# is prose and wraps at its spaces.
SHORT_CELL = 32
# Wider than any table qerl prints; the measure's bound, not a width anything is printed at.
_MEASURE_CEILING = 100_000
