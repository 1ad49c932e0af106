def run_all(dest, copy_tree, env):
    return []
