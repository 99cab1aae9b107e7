"""The one base class of every error a user can fix (docs/architecture.md, "Errors").

Each module raises its own subclass (ConfigError, CheckpointError, GenerationError, ExportError, ArtifactError,
PeerError: llama.cpp's tools in `bench`),
whose message names the field, tensor, file or option; the CLI prints any UserError as one `Error:` line and exits 1.
A leaf: it imports nothing of k3compile.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input (a config, a checkpoint, an option, a folder): the message says what and where."""
