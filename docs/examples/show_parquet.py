"""Print a few rows of the demo's Parquet replay with rich, and check it holds exactly the
committed orders: the 9 checkout orders and 3 refunds, once each, none of the abandoned basket.

    python docs/examples/show_parquet.py orders.parquet
"""

from __future__ import annotations

import sys

import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table


def main(path: str) -> int:
    rows = pq.read_table(path).to_pylist()
    rows.sort(key=lambda r: (r["journal"], r["commit_offset"], r["offset"]))
    table = Table(title=f"{path}: {len(rows)} rows (first 6)")
    for column in ("journal", "offset", "producer", "clock", "order", "total"):
        table.add_column(
            column, justify="right" if column in ("offset", "clock", "total") else "left"
        )
    for r in rows[:6]:
        table.add_row(r["journal"], str(r["offset"]), r["producer"], str(r["clock"]), r["order"],
                      str(r["total"]))  # fmt: skip
    Console().print(table)
    orders = sorted(r["order"] for r in rows)
    expected = sorted([f"order-{n}" for n in range(9)] + [f"refund-{n}" for n in range(3)])
    if orders != expected:
        print(f"the replay holds {orders}, expected {expected}", file=sys.stderr)
        return 1
    print("the replay holds each committed order once, and none of the abandoned basket")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
