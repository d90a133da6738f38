//! The full-screen mode of `kmqd stats --watch`: the terminal in raw mode on its alternate screen, the table
//! redrawn after every poll and every resize, keys read between polls.
//!
//! The terminal is put back (cursor shown, main screen, cooked mode) on every way out: q, Esc or Ctrl-C (a key
//! in raw mode), SIGTERM, SIGINT or SIGHUP (a flag the loop looks at every 100 ms), an error, and a panic (the
//! panic hook restores it before the message is printed, so the message lands on a sane terminal).

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, TryRecvError};
use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use crossterm::{cursor, execute, queue, style, terminal};

use super::{Poll, Watch, view};
use crate::cli::Failure;
use crate::cli::colour::Colour;

/// How often the loop looks at the keys, the signals and the poller.
const TICK: Duration = Duration::from_millis(100);

/// Whether the terminal is in the view's state, so that restoring it happens once whichever way out comes first.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The terminal in the view's state while this lives.
struct Screen;

impl Screen {
    fn enter() -> std::io::Result<Screen> {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
        terminal::enable_raw_mode()?;
        ACTIVE.store(true, Ordering::SeqCst);
        execute!(
            std::io::stdout(),
            terminal::EnterAlternateScreen,
            cursor::Hide
        )?;
        Ok(Screen)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        restore();
    }
}

/// Puts the terminal back as it was; does nothing when it is already.
fn restore() {
    if ACTIVE.swap(false, Ordering::SeqCst) {
        let _ = execute!(
            std::io::stdout(),
            cursor::Show,
            terminal::LeaveAlternateScreen
        );
        let _ = terminal::disable_raw_mode();
    }
}

fn io_failure(error: std::io::Error) -> Failure {
    Failure::Runtime(format!("terminal: {error}"))
}

/// What a key asks for.
enum Key {
    Quit,
    Scroll(isize),
    Other,
}

fn key(event: KeyEvent) -> Key {
    if event.kind == KeyEventKind::Release {
        return Key::Other;
    }
    match event.code {
        KeyCode::Char('c') if event.modifiers.contains(KeyModifiers::CONTROL) => Key::Quit,
        KeyCode::Char('q' | 'Q') | KeyCode::Esc => Key::Quit,
        KeyCode::Up | KeyCode::Char('k') => Key::Scroll(-1),
        KeyCode::Down | KeyCode::Char('j') => Key::Scroll(1),
        KeyCode::PageUp => Key::Scroll(-10),
        KeyCode::PageDown => Key::Scroll(10),
        _ => Key::Other,
    }
}

pub(super) fn run(
    mut watch: Watch,
    polls: &Receiver<Poll>,
    interval: Duration,
    colour: Colour,
) -> Result<(), Failure> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .map_err(|error| Failure::Runtime(format!("cannot handle signal {signal}: {error}")))?;
    }
    let _screen = Screen::enter().map_err(io_failure)?;
    let mut scroll = 0usize;
    let mut dirty = true;
    while !stop.load(Ordering::SeqCst) {
        if dirty {
            draw(&watch, scroll, interval, colour).map_err(io_failure)?;
            dirty = false;
        }
        if event::poll(TICK).map_err(io_failure)? {
            match event::read().map_err(io_failure)? {
                Event::Key(event) => match key(event) {
                    Key::Quit => break,
                    Key::Scroll(by) => {
                        scroll = scroll
                            .saturating_add_signed(by)
                            .min(watch.rows().len().saturating_sub(1));
                        dirty = true;
                    }
                    Key::Other => {}
                },
                Event::Resize(..) => dirty = true,
                _ => {}
            }
        }
        match polls.try_recv() {
            Ok(poll) => {
                watch.update(poll);
                dirty = true;
            }
            Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => {
                return Err(Failure::Runtime("the poller stopped".to_string()));
            }
        }
    }
    Ok(())
}

/// Redraws the whole screen.
fn draw(watch: &Watch, scroll: usize, interval: Duration, colour: Colour) -> std::io::Result<()> {
    let (width, height) = terminal::size()?;
    let frame = view::Frame {
        rows: watch.rows(),
        interval,
        updated: watch.updated_local.as_deref(),
        error: watch.error(),
        scroll,
    };
    let mut out = std::io::stdout().lock();
    for (row, (style, text)) in view::render(&frame, width.into(), height.into())
        .into_iter()
        .enumerate()
    {
        queue!(
            out,
            cursor::MoveTo(0, row as u16),
            style::Print(colour.paint(style, &text)),
            terminal::Clear(terminal::ClearType::UntilNewLine)
        )?;
        if row + 1 == height as usize {
            break;
        }
    }
    queue!(out, terminal::Clear(terminal::ClearType::FromCursorDown))?;
    out.flush()
}
