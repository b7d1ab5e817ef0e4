"""The one place that reaches into mlx-lm's private helpers.

``mlx_lm.utils._get_classes`` maps a config to its model classes, with mlx-lm's own remapping
of model types and architectures. It is private, so pyproject.toml pins mlx-lm to the range the
suite was run against, and tests/test_synth.py checks it for every family we build.
"""


def model_classes(config: dict):
    """``(Model, ModelArgs)`` of mlx-lm for ``config``.

    Raises:
        ValueError: if mlx-lm does not know the model type.
    """
    from mlx_lm import utils

    get_classes = getattr(utils, "_get_classes", None)
    if get_classes is None:
        import mlx_lm

        raise ValueError(f"mlx-lm {mlx_lm.__version__} has no _get_classes; expertd supports "
                         "the mlx-lm versions pinned in its pyproject.toml")
    return get_classes(config)
