"""What every section shares: the error a user mistake raises, and the check for positive fields."""


class ConfigError(ValueError):
    """A user mistake in a recipe or an override; the message says how to fix it."""


def positive(obj, *names):
    """Raise a ConfigError naming `section.field` for each of `names` of `obj` that is not > 0."""
    from .tree import section_of

    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{section_of(obj)}.{name}={value} must be positive.")
