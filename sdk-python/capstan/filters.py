"""kopf's combinators for callable filters: `all_`, `any_`, `none_`, usable wherever a
callable condition is (`when=`, and the values of `labels=`, `annotations=`, `value=`)."""


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def all_(fns):
    """True when every callable is true (kopf.all_)."""
    fns = list(fns)
    return lambda *args, **kwargs: all(_call(fn, args, kwargs) for fn in fns)


def any_(fns):
    """True when any callable is true (kopf.any_)."""
    fns = list(fns)
    return lambda *args, **kwargs: any(_call(fn, args, kwargs) for fn in fns)


def none_(fns):
    """True when no callable is true (kopf.none_)."""
    fns = list(fns)
    return lambda *args, **kwargs: not any(_call(fn, args, kwargs) for fn in fns)


def not_(fn):
    """True when the callable is false (kopf.not_)."""
    return lambda *args, **kwargs: not _call(fn, args, kwargs)
