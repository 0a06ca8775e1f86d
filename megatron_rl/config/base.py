"""What every section shares: the errors a user mistake raises, and the check for positive fields."""


class UserError(Exception):
    """Something the user can fix (a recipe, an override, a data file, a checkpoint path, the launch): its
    message is one sentence saying what, where and how to fix it. train.py prints that sentence alone, exits
    2 and removes the run directory it had just made. Any other exception is a bug: train.py prints its
    traceback and keeps the run directory."""


class ConfigError(UserError, ValueError):
    """A user mistake in a recipe, an override, or what they name (a path, a checkpoint); the message says
    how to fix it."""


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
