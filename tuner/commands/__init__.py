"""The tuner's commands, by group (api/cli.py gathers them into `pnmix`):

    options    the options they share and the helpers that parse them
    render     printing scores, fronts, held-out scores, ties
    scoring    eval, validate, layers
    campaigns  tune, worker, sweep, run (the main job)
    results    fronts, recommend, export, dashboard
"""
