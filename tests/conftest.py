"""pytest loads this first; its folder (tests/) then is on sys.path, so tests import titan_testing."""
