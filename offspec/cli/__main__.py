"""`python -m offspec.cli ARGS` runs `offspec ARGS`."""
from offspec.cli.main import main

main()
