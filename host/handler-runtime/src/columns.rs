//! Columns: items of varying length (ids, each device's NUMA nodes) held one after another in
//! one buffer, with where each ends. This is the form the packed allocation request takes
//! across into a guest ([`crate::Candidates`]) and the form the device manager keeps a plugin's
//! devices in, so candidates are cut from a device set a run of devices at a time
//! ([`TextColumn::run`], [`TextColumn::extend_from`]): one copy per run instead of one per device.

use std::ops::Range;

/// An end offset in a column. The host builds columns from a plugin's device list, which is
/// bounded far below 4 GiB on the wire, so a larger column is a bug.
fn end(len: usize) -> u32 {
    u32::try_from(len).expect("a column holds less than 4 GiB")
}

/// Where item `at` of a column whose items end at `ends` starts and ends.
fn span(ends: &[u32], at: usize) -> Range<usize> {
    let start = at.checked_sub(1).map_or(0, |before| ends[before] as usize);
    start..ends[at] as usize
}

/// Where the items of `range` start and end in their buffer.
fn run_span(ends: &[u32], range: &Range<usize>) -> (u32, u32) {
    let start = range.start.checked_sub(1).map_or(0, |before| ends[before]);
    let stop = ends[range.clone()].last().copied().unwrap_or(start);
    (start, stop)
}

/// Adds `ends` (counted from `start` in the column they were cut from) after a buffer now
/// `base` long.
fn extend_ends(into: &mut Vec<u32>, base: usize, ends: &[u32], start: u32) {
    let base = end(base);
    into.extend(ends.iter().map(|&e| base + (e - start)));
}

/// Strings one after another in one `String`, with where each ends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextColumn {
    text: String,
    ends: Vec<u32>,
}

impl TextColumn {
    /// Room for `items` strings of `bytes` bytes in all.
    pub fn with_capacity(items: usize, bytes: usize) -> TextColumn {
        TextColumn {
            text: String::with_capacity(bytes),
            ends: Vec::with_capacity(items),
        }
    }

    /// Adds a string.
    pub fn push(&mut self, item: &str) {
        self.text.push_str(item);
        self.ends.push(end(self.text.len()));
    }

    /// How many strings.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// String `at` (which must be below [`TextColumn::len`]).
    pub fn get(&self, at: usize) -> &str {
        &self.text[span(&self.ends, at)]
    }

    /// The strings one after another.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Where each string ends in [`TextColumn::text`].
    pub fn ends(&self) -> &[u32] {
        &self.ends
    }

    /// The strings at `range` (within [`TextColumn::len`]), borrowed as they lie.
    pub fn run(&self, range: Range<usize>) -> TextRun<'_> {
        let (start, stop) = run_span(&self.ends, &range);
        TextRun {
            text: &self.text[start as usize..stop as usize],
            ends: &self.ends[range],
            start,
        }
    }

    /// Adds the strings of `run`: one copy of its text and one of its ends.
    pub fn extend_from(&mut self, run: TextRun<'_>) {
        extend_ends(&mut self.ends, self.text.len(), run.ends, run.start);
        self.text.push_str(run.text);
    }

    /// Gives back spare capacity.
    pub fn shrink_to_fit(&mut self) {
        self.text.shrink_to_fit();
        self.ends.shrink_to_fit();
    }
}

/// Consecutive strings cut from a [`TextColumn`] ([`TextColumn::run`]).
#[derive(Clone, Copy, Debug)]
pub struct TextRun<'a> {
    text: &'a str,
    ends: &'a [u32],
    /// Where the first string starts in the column the run was cut from.
    start: u32,
}

/// Lists one after another in one `Vec`, with where each ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListColumn<T> {
    items: Vec<T>,
    ends: Vec<u32>,
}

impl<T> Default for ListColumn<T> {
    fn default() -> ListColumn<T> {
        ListColumn {
            items: Vec::new(),
            ends: Vec::new(),
        }
    }
}

impl<T: Copy> ListColumn<T> {
    /// Room for `lists` lists of `items` items in all.
    pub fn with_capacity(lists: usize, items: usize) -> ListColumn<T> {
        ListColumn {
            items: Vec::with_capacity(items),
            ends: Vec::with_capacity(lists),
        }
    }

    /// Adds a list.
    pub fn push(&mut self, list: &[T]) {
        self.items.extend_from_slice(list);
        self.ends.push(end(self.items.len()));
    }

    /// How many lists.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// List `at` (which must be below [`ListColumn::len`]).
    pub fn get(&self, at: usize) -> &[T] {
        &self.items[span(&self.ends, at)]
    }

    /// The lists' items one after another.
    pub fn items(&self) -> &[T] {
        &self.items
    }

    /// Where each list ends in [`ListColumn::items`].
    pub fn ends(&self) -> &[u32] {
        &self.ends
    }

    /// The lists at `range` (within [`ListColumn::len`]), borrowed as they lie.
    pub fn run(&self, range: Range<usize>) -> ListRun<'_, T> {
        let (start, stop) = run_span(&self.ends, &range);
        ListRun {
            items: &self.items[start as usize..stop as usize],
            ends: &self.ends[range],
            start,
        }
    }

    /// Adds the lists of `run`: one copy of its items and one of its ends.
    pub fn extend_from(&mut self, run: ListRun<'_, T>) {
        extend_ends(&mut self.ends, self.items.len(), run.ends, run.start);
        self.items.extend_from_slice(run.items);
    }

    /// Gives back spare capacity.
    pub fn shrink_to_fit(&mut self) {
        self.items.shrink_to_fit();
        self.ends.shrink_to_fit();
    }
}

/// Consecutive lists cut from a [`ListColumn`] ([`ListColumn::run`]).
#[derive(Debug)]
pub struct ListRun<'a, T> {
    items: &'a [T],
    ends: &'a [u32],
    /// Where the first list starts in the column the run was cut from.
    start: u32,
}

impl<T> Clone for ListRun<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for ListRun<'_, T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_cut_from_one_column_extends_another_as_the_items_one_by_one_would() {
        let texts = ["a", "bb", "é", "", "dd"];
        let lists: [&[i64]; 5] = [&[0], &[], &[1, 2], &[3], &[]];
        let mut text = TextColumn::default();
        let mut list = ListColumn::default();
        for (t, l) in texts.iter().zip(lists) {
            text.push(t);
            list.push(l);
        }
        for range in [0..0, 0..5, 1..4, 2..3, 4..5, 5..5] {
            let mut got_text = TextColumn::with_capacity(0, 0);
            let mut got_list = ListColumn::with_capacity(0, 0);
            got_text.push("x");
            got_list.push(&[9]);
            got_text.extend_from(text.run(range.clone()));
            got_list.extend_from(list.run(range.clone()));
            let mut want_text = TextColumn::default();
            let mut want_list = ListColumn::default();
            want_text.push("x");
            want_list.push(&[9]);
            for at in range.clone() {
                want_text.push(texts[at]);
                want_list.push(lists[at]);
            }
            assert_eq!(got_text, want_text, "{range:?}");
            assert_eq!(got_list, want_list, "{range:?}");
            assert_eq!(got_text.len(), 1 + range.len());
            for (i, at) in range.clone().enumerate() {
                assert_eq!(got_text.get(i + 1), texts[at]);
                assert_eq!(got_list.get(i + 1), lists[at]);
            }
        }
    }
}
