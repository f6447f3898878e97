"""The chapters' figures: static plots (`viz`, `plots`, `diagram`) and the site's interactive
charts (`charts`). They read models and numbers; nothing in the package imports them."""
