"""What every section shares: the error a user mistake raises, and the check for positive fields."""


class ConfigError(ValueError):
    """A user mistake in a recipe or an override; the message says how to fix it."""


def section_of(obj) -> str:
    """The section under which `obj`'s class sits in Config: its class name without 'Config', in lower case
    ('optimizer' for OptimizerConfig, 'lora' for LoRAConfig; tests/test_structure.py checks every section)."""
    return type(obj).__name__.removesuffix("Config").lower()


def positive(obj, *names):
    """Raise a ConfigError naming `section.field` for each of `names` of `obj` that is not > 0."""
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{section_of(obj)}.{name}={value} must be positive.")
