"""Command lines tests build from defaults plus a case's overrides."""


def merged(*args: str) -> list[str]:
    """``args`` with each ``field=value`` override kept once, at its last value and place (fvx itself notes a field
    set twice; a test that builds on defaults means the later one)."""
    fields = [arg.partition("=")[0] if "=" in arg and not arg.startswith("-") else None for arg in args]
    last = {field: i for i, field in enumerate(fields) if field is not None}
    return [arg for i, (arg, field) in enumerate(zip(args, fields)) if field is None or last[field] == i]
