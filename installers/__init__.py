"""Builders of Shoal's installers: the PyInstaller bundle, the Linux .deb and .tar.zst, the
macOS .app and .dmg. Run them through scripts/build-installer."""
