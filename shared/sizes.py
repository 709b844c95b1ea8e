"""Byte counts as people read them: decimal units, as the dashboard, the budgets and the doctor show them."""

UNITS = ("B", "kB", "MB", "GB", "TB")


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB'; below 1000, whole bytes."""
    scale = 0
    while abs(n) >= 1000 and scale < len(UNITS) - 1:
        n, scale = n / 1000, scale + 1
    return f"{n:,.0f} B" if scale == 0 else f"{n:,.2f} {UNITS[scale]}"
