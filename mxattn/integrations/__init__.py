"""Optional integrations with other libraries. Each submodule imports its library only when it is imported itself
(``import mxattn`` never imports them)."""
