"""SGLang plugin tests: the torchvision stub goes in before anything imports sglang."""

from __future__ import annotations

from .sglang_env import add_plugins_path, install_torchvision_stub

install_torchvision_stub()
add_plugins_path()
