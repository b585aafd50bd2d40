if __name__ == "api":  # the checkout root on sys.path: the installed `api` is meant (pnmix/shadow.py)
    from pnmix.shadow import stand_aside

    stand_aside(__name__, __file__)

if __name__ == "api":  # the checkout root on sys.path: the installed `api` is meant (pnmix/shadow.py)
    from pnmix.shadow import stand_aside

    stand_aside(__name__, __file__)
