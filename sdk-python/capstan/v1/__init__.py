"""Generated from proto/capstan/v1 by sdk-python/generate.sh: do not edit."""
