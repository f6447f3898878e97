"""The chapters' figures: static plots (`viz`, `plots`, `diagram`) and the site's interactive
charts (`charts`). They read models and numbers; besides the chapters, only the playground's
export (`minigpt.recipes.export`) uses them."""
