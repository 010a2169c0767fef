"""Byte units. Bytes are the only internal unit; these helpers convert for display only.
Binary units, labelled as such (KiB = 2**10, MiB = 2**20, GiB = 2**30)."""

KIB = 2**10
MIB = 2**20
GIB = 2**30

_UNITS = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))


def format_bytes(num_bytes: int | None) -> str:
    """Human-readable binary size, e.g. 1536 -> '1.50 KiB'; None -> 'n/a'."""
    if num_bytes is None:
        return "n/a"
    for label, size in _UNITS:
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:,.2f} {label}"
    return f"{num_bytes:,} B"


def bytes_to_gib(num_bytes: int) -> float:
    return num_bytes / GIB
