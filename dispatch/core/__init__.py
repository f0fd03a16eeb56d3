"""What every part of dispatch stands on: the settings (`conf`), the database's errors and
helpers (`db`), client-side deadlines (`deadline`), the SQL loader (`sqlfiles`), the state
table (`states`), what installed apps add (`hooks`), an attempt's recorded progress
(`progress`) and the table of `manage.py dispatch` subcommands (`commands`). Nothing here
imports another part of dispatch."""
