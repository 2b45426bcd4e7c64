"""kopf's test kit under kopf's names: `kopf.testing.KopfRunner`."""

from capstan.testing import OperatorRunner as KopfRunner

__all__ = ["KopfRunner"]
